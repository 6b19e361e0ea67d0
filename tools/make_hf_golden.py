#!/usr/bin/env python3
"""Hugging Face model directories written by transformers 5 itself, with reference logits.

Builds one tiny random LlamaForCausalLM (float32, fixed seed, llama3 rope scaling with theta
500000, max_position_embeddings 512) and writes under tests/golden/hf_tf5/:

  f32_sharded/          save_pretrained(max_shard_size=...) of the f32 model: config.json (the
                        transformers 5 form: rope_parameters, dtype), generation_config.json,
                        model.safetensors.index.json and its shards (at least two).
  bf16/                 the same model cast to bfloat16 and saved (one model.safetensors).
  legacy_config.json    f32_sharded/config.json in the transformers 4 form (top-level rope_theta
                        and rope_scaling, torch_dtype); transformers 5 reads it back to the same
                        config, and a model loaded with it gives bit-identical logits (checked).
  reference.safetensors input_ids I32 [1, 300] (more than 256 tokens) and what transformers
                        computes for them (eager attention, CPU, one thread):
                          logits           F32  [300, 256]  the f32 model
                          bf16.logits_f32  F32  [300, 256]  bf16 weights computed in f32
                          bf16.logits_bf16 BF16 [300, 256]  bf16 weights computed in bf16
                        and greedy generate (do_sample=False) runs, each the prompt followed by
                        the new tokens as generate returns them:
                          generate.prompt / generate.ids             f32 model, 8 + 20 tokens
                          generate_long.prompt / generate_long.ids   f32 model, 260 + 20 tokens
                          bf16.generate.prompt / bf16.generate.ids   bf16 weights in f32, 8 + 20
  reference.json        the config, seeds, tensor list, the smallest top-1/top-2 logit gap of
                        each generate run, the errors between the references, the versions and
                        the command.

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_hf_golden.py [--out tests/golden/hf_tf5]
"""

import argparse
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
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
SEQ = 300  # more than 256, the context length that used to be the default
SEED = 2024
PROMPT_LEN, LONG_PROMPT_LEN, NEW_TOKENS = 8, 260, 20
MAX_SHARD_SIZE = "200KB"  # the f32 weights are ~430 KB: three shards

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    # Theta far from the default 10000, and llama3 frequency scaling whose three bands (kept,
    # interpolated, divided by the factor) all hold some of the 8 frequencies of head_dim 16:
    # wavelengths 6.3 < 16 (kept), 32 in [16, 64] (interpolated), >= 167 > 64 (scaled).
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def build():
    torch.manual_seed(SEED)
    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Weights at the scale of a trained model, not HF's N(0, 0.02) init (whose near-uniform
    # attention would hide a wrong rotary embedding): N(0, 1) embeddings, N(0, 1/fan_in) for
    # every matrix (so activations and logits are O(1) and attention is peaked), RMSNorm gains
    # 1 + 0.1 N(0, 1) (so a wrong norm shows).
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.eval()
    return model


def load(path, dtype, config_path=None):
    kw = {}
    if config_path:
        kw["config"] = LlamaConfig.from_json_file(config_path)
    m = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kw)
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


def scaled_err(a, b):
    """max |a - b| / max |b|, as the C++ tests measure it."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def legacy_form(cfg):
    """transformers 5's config.json dict in the form transformers 4 writes."""
    out = {}
    for k, v in cfg.items():
        if k == "rope_parameters":
            rope = dict(v)
            out["rope_theta"] = rope.pop("rope_theta")
            out["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        elif k == "dtype":
            out["torch_dtype"] = v
        else:
            out[k] = v
    return out


def one_line_lists(text):
    return re.sub(
        r"\[\s*([-0-9.e,\s]+?)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument(
        "--out", default=os.path.normpath(os.path.join(here, "..", "tests", "golden", "hf_tf5"))
    )
    args = ap.parse_args()
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__
    torch.set_num_threads(1)  # one thread: reductions in a fixed order
    torch.use_deterministic_algorithms(True)
    command = ".venv-tf5/bin/python tools/make_hf_golden.py" + "".join(
        " " + shlex.quote(a) for a in sys.argv[1:]
    )
    out = args.out
    f32_dir, bf16_dir = os.path.join(out, "f32_sharded"), os.path.join(out, "bf16")
    for d in (f32_dir, bf16_dir):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(out, exist_ok=True)

    model = build()
    model.save_pretrained(f32_dir, max_shard_size=MAX_SHARD_SIZE)
    shards = sorted(f for f in os.listdir(f32_dir) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and os.path.exists(
        os.path.join(f32_dir, "model.safetensors.index.json")
    ), os.listdir(f32_dir)
    model.to(torch.bfloat16).save_pretrained(bf16_dir)
    assert os.listdir(bf16_dir) and os.path.exists(os.path.join(bf16_dir, "model.safetensors"))
    del model

    # Everything from here on is computed from the saved directories, as a user would load them.
    gen = torch.Generator().manual_seed(SEED + 2)
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    long_prompt = input_ids[:, :LONG_PROMPT_LEN].clone()

    f32 = load(f32_dir, torch.float32)
    with open(os.path.join(f32_dir, "config.json")) as f:
        config_json = json.load(f)
    assert "rope_parameters" in config_json and "dtype" in config_json, config_json
    logits = logits_of(f32, input_ids)
    gen_ids, gen_margin = generate(f32, prompt)
    long_ids, long_margin = generate(f32, long_prompt)

    # The legacy config.json: transformers 5 reads it to the same model, bit for bit.
    legacy = legacy_form(config_json)
    legacy_path = os.path.join(out, "legacy_config.json")
    with open(legacy_path, "w") as f:
        f.write(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(f32_dir):
            shutil.copy(os.path.join(f32_dir, name), tmp)
        shutil.copy(legacy_path, os.path.join(tmp, "config.json"))
        old = load(tmp, torch.float32)
        assert old.config.rope_parameters == f32.config.rope_parameters, (
            old.config.rope_parameters,
            f32.config.rope_parameters,
        )
        assert torch.equal(logits_of(old, input_ids), logits), "legacy config: other logits"
        del old

    bf16 = load(bf16_dir, torch.bfloat16)
    with open(os.path.join(bf16_dir, "config.json")) as f:
        bf16_config = json.load(f)
    assert bf16_config.get("dtype") == "bfloat16", bf16_config
    logits_bf16 = logits_of(bf16, input_ids)
    assert logits_bf16.dtype == torch.bfloat16
    del bf16
    bf16_in_f32 = load(bf16_dir, torch.float32)  # the bf16 weights, exactly, computed in f32
    logits_bf16w_f32 = logits_of(bf16_in_f32, input_ids)
    bf16_gen_ids, bf16_gen_margin = generate(bf16_in_f32, prompt)

    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "bf16.logits_f32": logits_bf16w_f32,
        "bf16.logits_bf16": logits_bf16,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
        "generate_long.prompt": long_prompt.to(torch.int32),
        "generate_long.ids": long_ids.to(torch.int32),
        "bf16.generate.prompt": prompt.to(torch.int32),
        "bf16.generate.ids": bf16_gen_ids.to(torch.int32),
    }
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    st_path = os.path.join(out, "reference.safetensors")
    save_file(tensors, st_path, metadata={"format": "pt"})

    for root, dirs, files in os.walk(out):  # the library creates files private
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)

    errors = {
        "bf16.logits_bf16 vs bf16.logits_f32": scaled_err(logits_bf16, logits_bf16w_f32),
        "bf16.logits_f32 vs logits": scaled_err(logits_bf16w_f32, logits),
    }
    sizes = {}
    for root, dirs, files in os.walk(out):
        for name in sorted(files):
            p = os.path.join(root, name)
            sizes[os.path.relpath(p, out)] = os.path.getsize(p)
    info = {
        "hf_class": "LlamaForCausalLM",
        "attn_implementation": "eager",
        "config_json": config_json,
        "seed": SEED,
        "init": "embeddings N(0, 1); every other matrix N(0, 1/fan_in); RMSNorm gains "
        "1 + 0.1 N(0, 1)",
        "num_parameters": sum(p.numel() for p in f32.parameters()),
        "max_shard_size": MAX_SHARD_SIZE,
        "shards": shards,
        "input": {"seq": SEQ, "note": "input_ids[0, :%d] is generate_long.prompt" % LONG_PROMPT_LEN},
        "generate": {
            "generate": {
                "prompt": prompt[0].tolist(),
                "ids": gen_ids[0].tolist(),
                "min_top1_top2_logit_margin": gen_margin,
            },
            "generate_long": {
                "prompt_len": LONG_PROMPT_LEN,
                "new_ids": long_ids[0, LONG_PROMPT_LEN:].tolist(),
                "min_top1_top2_logit_margin": long_margin,
            },
            "bf16.generate": {
                "prompt": prompt[0].tolist(),
                "ids": bf16_gen_ids[0].tolist(),
                "min_top1_top2_logit_margin": bf16_gen_margin,
            },
            "max_new_tokens": NEW_TOKENS,
            "do_sample": False,
        },
        "reference_errors_max_abs_over_max_abs": errors,
        "tensors": {
            k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()
        },
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
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(one_line_lists(json.dumps(info, indent=2)) + "\n")
    os.chmod(os.path.join(out, "reference.json"), 0o644)
    print(
        f"{out}: {sum(sizes.values())} bytes in {len(sizes) + 1} files; shards {shards}; "
        f"margins {gen_margin:.4g} / {long_margin:.4g} / {bf16_gen_margin:.4g}; errors {errors}"
    )


if __name__ == "__main__":
    main()
