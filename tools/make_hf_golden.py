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
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import golden_common as gc

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
    # Weights at the scale of a trained model (golden_common.trained_init).
    return gc.build(LlamaConfig, LlamaForCausalLM, CONFIG, SEED)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(gc.repo_root(), "tests", "golden", "hf_tf5"))
    args = ap.parse_args()
    command = gc.setup("make_hf_golden.py")
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
    input_ids, prompt = gc.random_inputs(SEED, VOCAB, SEQ, PROMPT_LEN)
    long_prompt = input_ids[:, :LONG_PROMPT_LEN].clone()

    f32 = gc.load(LlamaForCausalLM, f32_dir)
    config_json = gc.read_config(f32_dir)
    logits = gc.logits_of(f32, input_ids)
    gen_ids, gen_margin = gc.generate(f32, prompt, NEW_TOKENS)
    long_ids, long_margin = gc.generate(f32, long_prompt, NEW_TOKENS)

    # The legacy config.json: transformers 5 reads it to the same model, bit for bit.
    legacy_path = os.path.join(out, "legacy_config.json")
    gc.write_json(legacy_path, gc.legacy_form(config_json), one_line=False)

    def same_rope(old):
        assert old.config.rope_parameters == f32.config.rope_parameters, (
            old.config.rope_parameters,
            f32.config.rope_parameters,
        )

    old_logits = gc.logits_with_config(LlamaForCausalLM, f32_dir, legacy_path, input_ids, check=same_rope)
    assert torch.equal(old_logits, logits), "legacy config: other logits"

    bf16 = gc.load(LlamaForCausalLM, bf16_dir, torch.bfloat16)
    with open(os.path.join(bf16_dir, "config.json")) as f:
        bf16_config = json.load(f)
    assert bf16_config.get("dtype") == "bfloat16", bf16_config
    logits_bf16 = gc.logits_of(bf16, input_ids)
    assert logits_bf16.dtype == torch.bfloat16
    del bf16
    bf16_in_f32 = gc.load(LlamaForCausalLM, bf16_dir)  # the bf16 weights, exactly, computed in f32
    logits_bf16w_f32 = gc.logits_of(bf16_in_f32, input_ids)
    bf16_gen_ids, bf16_gen_margin = gc.generate(bf16_in_f32, prompt, NEW_TOKENS)

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
    tensors = gc.save_tensors(os.path.join(out, "reference.safetensors"), tensors)
    gc.chmod_tree(out)

    errors = {
        "bf16.logits_bf16 vs bf16.logits_f32": gc.scaled_err(logits_bf16, logits_bf16w_f32),
        "bf16.logits_f32 vs logits": gc.scaled_err(logits_bf16w_f32, logits),
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
        "tensors": gc.tensor_list(tensors),
        "file_sizes": sizes,
        "versions": gc.versions(),
        "command": command,
    }
    gc.write_reference_json(os.path.join(out, "reference.json"), info, lists="numbers")
    print(
        f"{out}: {sum(sizes.values())} bytes in {len(sizes) + 1} files; shards {shards}; "
        f"margins {gen_margin:.4g} / {long_margin:.4g} / {bf16_gen_margin:.4g}; errors {errors}"
    )


if __name__ == "__main__":
    main()
