#!/usr/bin/env python3
"""Tiny Mistral and Mixtral directories written by transformers 5, with reference logits.

For each family (mistral, mixtral) builds one tiny random model in float32 (fixed seeds, weights
at the scale of a trained model), saves it with save_pretrained, and writes under
tests/golden/<family>/:

  hf/                   save_pretrained's directory: config.json in the transformers 5 form
                        (rope_parameters, dtype), generation_config.json, model.safetensors
                        (Mixtral's experts as transformers 5 writes them:
                        model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight and
                        block_sparse_moe.gate.weight).
  legacy_config.json    hf/config.json in the transformers 4 form (top-level rope_theta,
                        rope_scaling null, torch_dtype); transformers 5 reads it back to the same
                        config, and the model loaded with it gives bit-identical logits (checked).
  reference.safetensors input_ids I32 [1, SEQ] and, computed from the saved directory (eager
                        attention, CPU, one thread):
                          logits                     F32 [SEQ, VOCAB]
                          generate.prompt / .ids     greedy generate, 8 + 20 tokens
                          generate_long.prompt / .ids  greedy generate, 60 + 20 tokens (past the
                                                     Mistral model's sliding window of 16)
  reference.json        config.json, seeds, the smallest top-1/top-2 logit gap of each generate
                        run, for Mixtral the smallest gap between a token's k-th and (k+1)-th
                        router probability (what an exact routing match can absorb), file sizes,
                        the versions and the command.

Models (vocabulary 128, width 64, 4 query / 2 key-value heads of 16, 2 layers, untied):
  mistral   MLP 128, sliding_window 16, rope theta 20000, rms_norm_eps 1e-5
  mixtral   8 experts of 32, top 2, no sliding window, rope theta 1e6, rms_norm_eps 1e-5

Weights: embeddings N(0, 1), every matrix N(0, 1/fan_in) (so activations and logits are O(1)
and attention is peaked: a wrong rotary embedding or window shows), RMSNorm gains
1 + 0.1 N(0, 1).

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_family_golden.py [--out tests/golden] [--family mistral]
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
from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

VOCAB = 128
SEQ = 80
PROMPT_LEN, LONG_PROMPT_LEN, NEW_TOKENS = 8, 60, 20

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    "mistral": dict(
        config_class=MistralConfig,
        model_class=MistralForCausalLM,
        seed=3031,
        config=dict(
            COMMON,
            intermediate_size=128,
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
    ),
    "mixtral": dict(
        config_class=MixtralConfig,
        model_class=MixtralForCausalLM,
        seed=3032,
        config=dict(
            COMMON,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
            router_jitter_noise=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
}


def build(spec):
    torch.manual_seed(spec["seed"])
    config = spec["config_class"](**spec["config"])
    model = spec["model_class"](config).to(torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # [..., out, in]: fan_in is the last dimension (experts' stacks included)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.eval()
    return model


def load(spec, path, config_path=None):
    kw = {}
    if config_path:
        kw["config"] = spec["config_class"].from_json_file(config_path)
    m = spec["model_class"].from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kw
    )
    m.eval()
    return m


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def router_margin(model, ids, k):
    """Smallest gap between a token's k-th and (k+1)-th router probability, over the layers."""
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(p, k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


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


def make(family, out_root, command):
    spec = FAMILIES[family]
    out = os.path.join(out_root, family)
    hf_dir = os.path.join(out, "hf")
    shutil.rmtree(hf_dir, ignore_errors=True)
    os.makedirs(out, exist_ok=True)

    model = build(spec)
    model.save_pretrained(hf_dir)
    del model

    # Everything from here on is computed from the saved directory, as a user would load it.
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    long_prompt = input_ids[:, :LONG_PROMPT_LEN].clone()

    m = load(spec, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config_json = json.load(f)
    assert "rope_parameters" in config_json and "dtype" in config_json, config_json
    logits = logits_of(m, input_ids)
    gen_ids, gen_margin = generate(m, prompt)
    long_ids, long_margin = generate(m, long_prompt)
    routing = None
    if family == "mixtral":
        routing = {
            "input": router_margin(m, input_ids, 2),
            "generate_long": router_margin(m, long_ids, 2),
            "generate": router_margin(m, gen_ids, 2),
        }
        assert min(routing.values()) > 1e-4, routing

    legacy = legacy_form(config_json)
    legacy_path = os.path.join(out, "legacy_config.json")
    with open(legacy_path, "w") as f:
        f.write(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(hf_dir):
            shutil.copy(os.path.join(hf_dir, name), tmp)
        shutil.copy(legacy_path, os.path.join(tmp, "config.json"))
        old = load(spec, tmp)
        assert old.config.rope_parameters == m.config.rope_parameters, (
            old.config.rope_parameters,
            m.config.rope_parameters,
        )
        assert old.config.sliding_window == m.config.sliding_window
        assert torch.equal(logits_of(old, input_ids), logits), "legacy config: other logits"
        del old

    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
        "generate_long.prompt": long_prompt.to(torch.int32),
        "generate_long.ids": long_ids.to(torch.int32),
    }
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out, "reference.safetensors"), metadata={"format": "pt"})

    for root, dirs, files in os.walk(out):  # the library creates files private
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    sizes = {}
    for root, dirs, files in os.walk(out):
        for name in sorted(files):
            p = os.path.join(root, name)
            if name != "reference.json":
                sizes[os.path.relpath(p, out)] = os.path.getsize(p)
    info = {
        "hf_class": spec["model_class"].__name__,
        "attn_implementation": "eager",
        "config_json": config_json,
        "seed": spec["seed"],
        "init": "embeddings N(0, 1); every other matrix N(0, 1/fan_in); RMSNorm gains "
        "1 + 0.1 N(0, 1)",
        "num_parameters": sum(p.numel() for p in m.parameters()),
        "input": {"seq": SEQ, "note": "input_ids[0, :%d] is generate_long.prompt" % LONG_PROMPT_LEN},
        "max_abs_logit": logits.abs().max().item(),
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
            "max_new_tokens": NEW_TOKENS,
            "do_sample": False,
        },
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
    if routing is not None:
        info["min_router_kth_gap"] = routing
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(one_line_lists(json.dumps(info, indent=2)) + "\n")
    os.chmod(os.path.join(out, "reference.json"), 0o644)
    print(
        f"{out}: {sum(sizes.values())} bytes; margins {gen_margin:.4g} / {long_margin:.4g}"
        + (f"; router gaps {routing}" if routing else "")
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "tests", "golden")))
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    args = ap.parse_args()
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__
    torch.set_num_threads(1)  # one thread: reductions in a fixed order
    torch.use_deterministic_algorithms(True)
    command = ".venv-tf5/bin/python tools/make_family_golden.py" + "".join(
        " " + shlex.quote(a) for a in sys.argv[1:]
    )
    for family in args.family or sorted(FAMILIES):
        make(family, args.out, command)


if __name__ == "__main__":
    main()
