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
import os
import shutil

import torch
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import golden_common as gc

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


def init(name, p, gen):
    if p.dim() == 1 and not name.endswith("norm.weight"):
        # Qwen2's q/k/v biases: large enough that a lost one shows
        p.copy_(0.5 * gc.randn(p, gen))
    else:
        gc.trained_init(name, p, gen)


def legacy_form(cfg):
    """transformers 5's config.json dict in the form transformers 4 (and Qwen's hub) writes:
    4.x configs of Qwen3 have no layer_types, and transformers 5 writes Qwen3-MoE's num_experts
    by the alias num_local_experts."""
    return gc.legacy_form(cfg, skip=("layer_types",), rename={"num_local_experts": "num_experts"})


def make(name, out, command):
    config_cls, model_cls, cfg, seed = MODELS[name]
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model = gc.build(config_cls, model_cls, cfg, seed, init)
    num_parameters = gc.save_model(model, d)
    del model

    input_ids, prompt = gc.random_inputs(seed, VOCAB, SEQ, PROMPT_LEN)

    # Everything from here on is computed from the saved directory, as a user would load it.
    m = gc.load(model_cls, d)
    config_json = gc.read_config(d)
    logits = gc.logits_of(m, input_ids)
    gen_ids, gen_margin = gc.generate(m, prompt, NEW_TOKENS)

    weight_names = gc.weight_names(d)
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
    }

    legacy = legacy_form(config_json)
    gc.write_json(os.path.join(d, "legacy_config.json"), legacy)
    extra = {}
    weights = ["model.safetensors"]
    old_logits = gc.logits_with_config(
        model_cls, d, os.path.join(d, "legacy_config.json"), input_ids, files=weights
    )
    assert torch.equal(old_logits, logits), "legacy config: other logits"
    if name == "qwen3_moe":
        # The same weights with norm_topk_prob=false: the top-k weights are the softmax's.
        variant = copy.deepcopy(config_json)
        variant["norm_topk_prob"] = False
        variant_path = os.path.join(d, "no_norm_topk_config.json")
        gc.write_json(variant_path, variant)

        def check(nn):
            assert nn.config.norm_topk_prob is False

        tensors["no_norm_topk.logits"] = gc.logits_with_config(
            model_cls, d, variant_path, input_ids, files=weights, check=check
        )
        extra["no_norm_topk.logits vs logits (max abs / max abs)"] = gc.relative_diff(
            tensors["no_norm_topk.logits"], logits
        )

    tensors = gc.save_tensors(os.path.join(d, "reference.safetensors"), tensors)
    gc.chmod_tree(d)
    sizes = gc.file_sizes(d)
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
        "generate": gc.generate_info(prompt, gen_ids, gen_margin, NEW_TOKENS),
        "max_abs_logit": logits.abs().max().item(),
        "tensors": gc.tensor_list(tensors),
        "notes": extra,
        "file_sizes": sizes,
        "versions": gc.versions(),
        "command": command,
    }
    gc.write_reference_json(os.path.join(d, "reference.json"), info)
    print(f"{d}: {sum(sizes.values())} bytes; {num_parameters} parameters; margin {gen_margin:.4g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(gc.repo_root(), "tests", "golden"))
    args = ap.parse_args()
    command = gc.setup("make_qwen_golden.py")
    for name in MODELS:
        make(name, args.out, command)


if __name__ == "__main__":
    main()
