#!/usr/bin/env python3
"""Tiny Qwen2, Qwen3 and Qwen3-MoE directories written by transformers 5 itself, with reference logits.

Builds four tiny random float32 models, saves each with save_pretrained (config.json in the
transformers 5 form, weights as transformers 5 writes them by default) and records what
transformers computes for them, under tests/golden/ (qwen2/ too):

  qwen3_tied/         Qwen3ForCausalLM, tie_word_embeddings=true (as Qwen3-0.6B/1.7B/4B)
  qwen3_untied/       Qwen3ForCausalLM, a separate lm_head (as Qwen3-8B and larger)
  qwen2/              Qwen2ForCausalLM (Qwen2 / Qwen2.5): q/k/v biases N(0, 0.25), no q/k norms,
                      head_dim = 32 / 4 = 8, tied embeddings
  qwen3_moe/          Qwen3MoeForCausalLM, 8 experts, top 3, norm_topk_prob=true, 3 layers of
                      which layer 1 is dense (mlp_only_layers=[1]); experts saved per expert
                      (mlp.experts.<e>.{gate,up,down}_proj.weight: save_pretrained's default,
                      save_original_format=True, reverts transformers 5's fused 3-D tensors)

Each directory holds:

  config.json, generation_config.json, model.safetensors   as save_pretrained wrote them
  legacy_config.json    config.json in the transformers 4 form (top-level rope_theta and
                        rope_scaling null, torch_dtype, no layer_types); transformers 5 reads it
                        back to a model with bit-identical logits (checked here)
  reference.safetensors input_ids I32 [1, 100], logits F32 [100, 128] (eager attention, CPU, one
                        thread), generate.prompt I32 [1, 8] and generate.ids I32 [1, 28] (greedy
                        generate, do_sample=False, 20 new tokens: the prompt and the new tokens)
  reference.json        the config, seeds, init, smallest top-1/top-2 logit gap of the generate
                        run, versions and the command

qwen3_moe/ further holds no_norm_topk_config.json (the same model with norm_topk_prob=false) and
its logits as reference.safetensors's no_norm_topk.logits.

Weights are scaled like a trained model's, not HF's N(0, 0.02) init (whose near-uniform attention
would hide a wrong rotary embedding or q/k norm): embeddings N(0, 1), every matrix N(0, 1/fan_in)
(the router too, so routing is decisive), every RMSNorm gain (q_norm and k_norm included)
1 + 0.1 N(0, 1). Qwen3's head_dim (16) differs from hidden_size / num_attention_heads (8), and rope theta
is Qwen3's 1e6.

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_qwen_golden.py [--out tests/golden]
"""

import argparse
import copy
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
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 128
SEQ = 100
PROMPT_LEN, NEW_TOKENS = 8, 20

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # not hidden_size / num_attention_heads
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    "qwen3_tied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        2025,
    ),
    "qwen3_untied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(COMMON, num_hidden_layers=2, tie_word_embeddings=False),
        2026,
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            COMMON,
            num_hidden_layers=3,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
        2027,
    ),
    # Qwen2 / Qwen2.5: biases on q, k and v (always, whatever attention_bias says), no q/k
    # norms, head_dim = hidden_size / num_attention_heads (its config has no head_dim).
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            {k: v for k, v in COMMON.items() if k not in ("head_dim", "attention_bias")},
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
        2028,
    ),
}


def build(config_cls, model_cls, cfg, seed):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # Qwen2's q/k/v biases: large enough that a lost one shows
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                # [out, in] matrices and the experts' [E, out, in] stacks: fan_in is the last
                # dimension.
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.eval()
    return model


def load(model_cls, config_cls, path, config_path=None):
    kw = {}
    if config_path:
        kw["config"] = config_cls.from_json_file(config_path)
    m = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw)
    m.eval()
    return m


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def generate(model, prompt):
    with torch.no_grad():
        g = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    ids = g.sequences
    assert ids.shape == (1, prompt.shape[1] + NEW_TOKENS), ids.shape
    margins = []
    for s in g.scores:
        top2 = torch.topk(s[0].float(), 2).values
        margins.append((top2[0] - top2[1]).item())
    return ids, min(margins)


def legacy_form(cfg):
    """transformers 5's config.json dict in the form transformers 4 (and Qwen's hub) writes."""
    out = {}
    for k, v in cfg.items():
        if k == "rope_parameters":
            rope = dict(v)
            out["rope_theta"] = rope.pop("rope_theta")
            out["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        elif k == "dtype":
            out["torch_dtype"] = v
        elif k == "layer_types":
            continue  # 4.x configs of Qwen3 have none
        elif k == "num_local_experts":
            out["num_experts"] = v  # transformers 5 writes Qwen3-MoE's num_experts by this alias
        else:
            out[k] = v
    return out


def one_line_lists(text):
    return re.sub(
        r"\[\s*([-0-9.e,\s\"a-z_]+?)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def write_json(path, obj):
    with open(path, "w") as f:
        f.write(one_line_lists(json.dumps(obj, indent=2, sort_keys=True)) + "\n")


def make(name, out, command):
    config_cls, model_cls, cfg, seed = MODELS[name]
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model = build(config_cls, model_cls, cfg, seed)
    model.save_pretrained(d)
    num_parameters = sum(p.numel() for p in model.parameters())
    del model
    assert os.path.exists(os.path.join(d, "model.safetensors")), os.listdir(d)

    gen = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)

    # Everything from here on is computed from the saved directory, as a user would load it.
    m = load(model_cls, config_cls, d)
    with open(os.path.join(d, "config.json")) as f:
        config_json = json.load(f)
    assert "rope_parameters" in config_json and "dtype" in config_json, config_json
    logits = logits_of(m, input_ids)
    gen_ids, gen_margin = generate(m, prompt)

    with safetensors.safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        weight_names = sorted(f.keys())
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
    }

    legacy = legacy_form(config_json)
    write_json(os.path.join(d, "legacy_config.json"), legacy)
    extra = {}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(d, "model.safetensors"), tmp)
        shutil.copy(os.path.join(d, "legacy_config.json"), os.path.join(tmp, "config.json"))
        old = load(model_cls, config_cls, tmp)
        assert torch.equal(logits_of(old, input_ids), logits), "legacy config: other logits"
        del old
        if name == "qwen3_moe":
            # The same weights with norm_topk_prob=false: the top-k weights are the softmax's.
            variant = copy.deepcopy(config_json)
            variant["norm_topk_prob"] = False
            write_json(os.path.join(d, "no_norm_topk_config.json"), variant)
            shutil.copy(os.path.join(d, "no_norm_topk_config.json"), os.path.join(tmp, "config.json"))
            nn = load(model_cls, config_cls, tmp)
            assert nn.config.norm_topk_prob is False
            tensors["no_norm_topk.logits"] = logits_of(nn, input_ids)
            extra["no_norm_topk.logits vs logits (max abs / max abs)"] = (
                (tensors["no_norm_topk.logits"] - logits).abs().max() / logits.abs().max()
            ).item()
            del nn

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(d, "reference.safetensors"), metadata={"format": "pt"})
    for root, dirs, files in os.walk(d):  # the library creates files private
        for fn in files:
            os.chmod(os.path.join(root, fn), 0o644)
    sizes = {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}
    info = {
        "hf_class": model_cls.__name__,
        "attn_implementation": "eager",
        "config_json": config_json,
        "seed": seed,
        "init": "embeddings N(0, 1); every other matrix N(0, 1/fan_in) (router and experts "
        "too); RMSNorm gains (q_norm, k_norm included) 1 + 0.1 N(0, 1)",
        "num_parameters": num_parameters,
        "weights": weight_names,
        "input": {"seq": SEQ},
        "generate": {
            "prompt": prompt[0].tolist(),
            "ids": gen_ids[0].tolist(),
            "max_new_tokens": NEW_TOKENS,
            "do_sample": False,
            "min_top1_top2_logit_margin": gen_margin,
        },
        "max_abs_logit": logits.abs().max().item(),
        "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()},
        "notes": extra,
        "file_sizes": sizes,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": numpy.__version__,
            "python": sys.version.split()[0],
        },
        "command": command,
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        f.write(one_line_lists(json.dumps(info, indent=2)) + "\n")
    os.chmod(os.path.join(d, "reference.json"), 0o644)
    print(f"{d}: {sum(sizes.values())} bytes; {num_parameters} parameters; margin {gen_margin:.4g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "tests", "golden")))
    args = ap.parse_args()
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__
    torch.set_num_threads(1)  # one thread: reductions in a fixed order
    torch.use_deterministic_algorithms(True)
    command = ".venv-tf5/bin/python tools/make_qwen_golden.py" + "".join(
        " " + shlex.quote(a) for a in sys.argv[1:]
    )
    for name in MODELS:
        make(name, args.out, command)


if __name__ == "__main__":
    main()
