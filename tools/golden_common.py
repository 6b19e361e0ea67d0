"""What the transformers 5 golden-data tools (make_hf, make_family, make_qwen, make_gemma, make_gpt,
make_deepseek _golden.py) share: the run setup and command line, trained-scale weight
initialisation, loading a saved directory with eager attention, logits, greedy generate with the
smallest top-1/top-2 gap, the transformers 4 ("legacy") config form and its bit-identical check,
and writing reference.safetensors / reference.json.

Every function here draws random numbers, orders keys and formats JSON exactly as the tools did
before it existed: the committed files under tests/golden/ are reproduced bit for bit.
"""

import json
import os
import re
import shlex
import shutil
import sys
import tempfile

import numpy
import safetensors
import torch
import transformers
from safetensors.torch import save_file


def setup(tool):
    """Checks transformers 5, fixes torch to one deterministic thread, returns the command line
    (as reference.json records it) of tools/<tool>."""
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__
    torch.set_num_threads(1)  # one thread: reductions in a fixed order
    torch.use_deterministic_algorithms(True)
    return ".venv-tf5/bin/python tools/" + tool + "".join(" " + shlex.quote(a) for a in sys.argv[1:])


def repo_root():
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def randn(p, gen):
    return torch.randn(p.shape, generator=gen)


def trained_init(name, p, gen):
    """Weights at the scale of a trained model, not HF's N(0, 0.02) init (whose near-uniform
    attention would hide a wrong rotary embedding): N(0, 1) embeddings, N(0, 1/fan_in) for every
    matrix ([..., out, in]: fan_in is the last dimension, experts' stacks included), RMSNorm gains
    1 + 0.1 N(0, 1) (so a wrong norm shows). Returns False for a name it does not handle."""
    if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * randn(p, gen))
    elif name == "model.embed_tokens.weight":
        p.copy_(randn(p, gen))
    else:
        p.copy_(randn(p, gen) / p.shape[-1] ** 0.5)


def build(config_cls, model_cls, cfg, seed, init=trained_init, after=None):
    """A float32 model_cls(config_cls(**cfg)) built under torch.manual_seed(seed), its parameters
    then drawn in order by init(name, p, gen) from a generator seeded with seed + 1 (after(model,
    gen) draws anything further), in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init(name, p, gen)
        if after is not None:
            after(model, gen)
    model.eval()
    return model


def random_inputs(seed, vocab, seq, prompt_len):
    """input_ids [1, seq] and a prompt [1, prompt_len], from a generator seeded with seed + 2."""
    gen = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, vocab, (1, seq), generator=gen)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen)
    return input_ids, prompt


def load(model_cls, path, dtype=torch.float32):
    m = model_cls.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    m.eval()
    return m


def read_config(d, tf5_form=True):
    with open(os.path.join(d, "config.json")) as f:
        config_json = json.load(f)
    if tf5_form:
        assert "rope_parameters" in config_json and "dtype" in config_json, config_json
    return config_json


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def generate(model, prompt, new_tokens):
    """Greedy generate: the prompt followed by new_tokens tokens, and the smallest gap between the
    best and second-best logit over the steps (how much float error an exact match absorbs)."""
    with torch.no_grad():
        g = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids = g.sequences
    assert ids.shape == (1, prompt.shape[1] + new_tokens), ids.shape
    margins = []
    for s in g.scores:
        top2 = torch.topk(s[0].float(), 2).values
        margins.append((top2[0] - top2[1]).item())
    return ids, min(margins)


def generate_info(prompt, ids, margin, new_tokens):
    return {
        "prompt": prompt[0].tolist(),
        "ids": ids[0].tolist(),
        "max_new_tokens": new_tokens,
        "do_sample": False,
        "min_top1_top2_logit_margin": margin,
    }


def legacy_rope(v):
    """rope_parameters as transformers 4's top-level rope_theta and rope_scaling (None for the
    default rope)."""
    rope = dict(v)
    theta = rope.pop("rope_theta")
    return {
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
    }


def legacy_form(cfg, rope=legacy_rope, skip=(), rename=None):
    """transformers 5's config.json dict in the form transformers 4 writes: rope_parameters through
    rope(v), dtype as torch_dtype, the keys in skip left out, those in rename renamed."""
    rename = dict(rename or {}, dtype="torch_dtype")
    out = {}
    for k, v in cfg.items():
        if k == "rope_parameters":
            out.update(rope(v))
        elif k in skip:
            continue
        else:
            out[rename.get(k, k)] = v
    return out


def logits_with_config(model_cls, src_dir, config_path, input_ids, files=None, check=None):
    """The logits of src_dir's weights loaded with config_path as config.json (files: what to copy
    from src_dir, all by default); check(model) runs on the loaded model."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in files if files is not None else os.listdir(src_dir):
            shutil.copy(os.path.join(src_dir, name), tmp)
        shutil.copy(config_path, os.path.join(tmp, "config.json"))
        m = load(model_cls, tmp)
        if check is not None:
            check(m)
        logits = logits_of(m, input_ids)
        del m
    return logits


def scaled_err(a, b):
    """max |a - b| / max |b|, as the C++ tests measure it."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def one_line_lists(text, strings=True):
    """JSON lists of numbers (and, with strings, of simple strings) on one line."""
    pattern = r"\[\s*([-0-9.e,\s\"a-z_]+?)\s*\]" if strings else r"\[\s*([-0-9.e,\s]+?)\s*\]"
    return re.sub(
        pattern,
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def write_json(path, obj, one_line=True):
    """A config file: sorted keys, lists of numbers and names on one line (one_line)."""
    text = json.dumps(obj, indent=2, sort_keys=True)
    with open(path, "w") as f:
        f.write((one_line_lists(text) if one_line else text) + "\n")


def save_tensors(path, tensors):
    """Writes the tensors (made contiguous) as safetensors; returns them as written."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def chmod_tree(d):
    for root, dirs, files in os.walk(d):  # the library creates files private
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def tensor_list(tensors):
    return {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()}


def versions(*extra):
    """The versions reference.json records; extra modules (tokenizers) after transformers."""
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    for module in extra:
        out[module.__name__] = module.__version__
    out["safetensors"] = safetensors.__version__
    out["numpy"] = numpy.__version__
    out["python"] = sys.version.split()[0]
    return out


def write_reference_json(path, info, lists="strings"):
    """reference.json, in the original key order: lists "strings" (numbers and names on one
    line), "numbers" (numbers only on one line) or None (json as is, non-ASCII kept)."""
    if lists is None:
        text = json.dumps(info, indent=2, ensure_ascii=False)
    else:
        text = one_line_lists(json.dumps(info, indent=2), strings=lists == "strings")
    with open(path, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o644)


def save_model(model, d):
    """save_pretrained into d (one model.safetensors); returns the number of parameters."""
    model.save_pretrained(d)
    num_parameters = sum(p.numel() for p in model.parameters())
    assert os.path.exists(os.path.join(d, "model.safetensors")), os.listdir(d)
    return num_parameters


def weight_names(d):
    with safetensors.safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def file_sizes(d):
    return {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}


def relative_diff(a, b):
    """max |a - b| / max |b| in the tensors' own precision."""
    return ((a - b).abs().max() / b.abs().max()).item()
