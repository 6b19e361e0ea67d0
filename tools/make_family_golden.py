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
import os
import shutil

import torch
from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

import golden_common as gc

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


def make(family, out_root, command):
    spec = FAMILIES[family]
    out = os.path.join(out_root, family)
    hf_dir = os.path.join(out, "hf")
    shutil.rmtree(hf_dir, ignore_errors=True)
    os.makedirs(out, exist_ok=True)

    model = gc.build(spec["config_class"], spec["model_class"], spec["config"], spec["seed"])
    model.save_pretrained(hf_dir)
    del model

    # Everything from here on is computed from the saved directory, as a user would load it.
    input_ids, prompt = gc.random_inputs(spec["seed"], VOCAB, SEQ, PROMPT_LEN)
    long_prompt = input_ids[:, :LONG_PROMPT_LEN].clone()

    m = gc.load(spec["model_class"], hf_dir)
    config_json = gc.read_config(hf_dir)
    logits = gc.logits_of(m, input_ids)
    gen_ids, gen_margin = gc.generate(m, prompt, NEW_TOKENS)
    long_ids, long_margin = gc.generate(m, long_prompt, NEW_TOKENS)
    routing = None
    if family == "mixtral":
        routing = {
            "input": router_margin(m, input_ids, 2),
            "generate_long": router_margin(m, long_ids, 2),
            "generate": router_margin(m, gen_ids, 2),
        }
        assert min(routing.values()) > 1e-4, routing

    legacy_path = os.path.join(out, "legacy_config.json")
    gc.write_json(legacy_path, gc.legacy_form(config_json), one_line=False)

    def same_config(old):
        assert old.config.rope_parameters == m.config.rope_parameters, (
            old.config.rope_parameters,
            m.config.rope_parameters,
        )
        assert old.config.sliding_window == m.config.sliding_window

    old_logits = gc.logits_with_config(spec["model_class"], hf_dir, legacy_path, input_ids, check=same_config)
    assert torch.equal(old_logits, logits), "legacy config: other logits"

    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
        "generate_long.prompt": long_prompt.to(torch.int32),
        "generate_long.ids": long_ids.to(torch.int32),
    }
    tensors = gc.save_tensors(os.path.join(out, "reference.safetensors"), tensors)
    gc.chmod_tree(out)
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
        "tensors": gc.tensor_list(tensors),
        "file_sizes": sizes,
        "versions": gc.versions(),
        "command": command,
    }
    if routing is not None:
        info["min_router_kth_gap"] = routing
    gc.write_reference_json(os.path.join(out, "reference.json"), info, lists="numbers")
    print(
        f"{out}: {sum(sizes.values())} bytes; margins {gen_margin:.4g} / {long_margin:.4g}"
        + (f"; router gaps {routing}" if routing else "")
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(gc.repo_root(), "tests", "golden"))
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    args = ap.parse_args()
    command = gc.setup("make_family_golden.py")
    for family in args.family or sorted(FAMILIES):
        make(family, args.out, command)


if __name__ == "__main__":
    main()
