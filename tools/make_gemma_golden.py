#!/usr/bin/env python3
"""Tiny Gemma, Gemma 2 and Gemma 3 (text) directories written by transformers 5, with reference logits.

Builds three tiny random float32 models, saves each with save_pretrained (config.json in the
transformers 5 form) and records what transformers computes for them (eager attention, the
only implementation that soft-caps), under tests/golden/:

  gemma/    GemmaForCausalLM: GeGLU (gelu_pytorch_tanh), RMSNorm x (1 + w), embeddings x
            sqrt(hidden_size), tied output, multi-query attention (1 key/value head), 2 layers
  gemma2/   Gemma2ForCausalLM: 4 layers alternating sliding (window 16) and full attention,
            norms before and after attention and MLP, query_pre_attn_scalar 24 (not head_dim
            16), attention logits soft-capped at 10 and final logits at 8, with q/k, output and
            embedding weights scaled so that both caps bite (reference.json records by how much)
  gemma3/   Gemma3ForCausalLM (model_type gemma3_text): 7 layers, 5 sliding : 1 full (layer 5
            global, 6 sliding again), window 16, q/k RMSNorm (1 + w), rope theta 10000 on
            sliding layers and 1e6 with linear scaling x 8 on full ones, query_pre_attn_scalar
            24, no soft-caps (Gemma 3's default)

Every sequence is longer than the window: 100 scored tokens, and greedy generation from a
24-token prompt (the prefill already past the window) to 64 tokens.

Each directory holds:

  config.json, generation_config.json, model.safetensors   as save_pretrained wrote them
  legacy_config.json    config.json in the transformers 4 form Google published (top-level
                        rope_theta, rope_scaling, torch_dtype; no layer_types; Gemma's
                        hidden_act "gelu" beside hidden_activation null; Gemma 3's
                        rope_local_base_freq, sliding_window_pattern and rope_scaling
                        {rope_type linear, factor 8}); transformers 5 reads it back to a model
                        with bit-identical logits (checked here)
  reference.safetensors input_ids I32 [1, 100], logits F32 [100, 128], generate.prompt I32
                        [1, 24], generate.ids I32 [1, 64] (greedy, do_sample=False, 40 new
                        tokens); gemma2 also uncapped.logits: the same weights with both soft-caps
                        off (how much the caps change the logits)
  reference.json        the config, seeds, init, soft-cap statistics, the smallest top-1/top-2
                        logit gap of the generate run, versions and the command

Weights are scaled like a trained model's, not HF's init (RMSNorm gains 0, so 1 + w = 1, would
hide a norm read as w instead of 1 + w): embeddings N(0, 1/hidden) (so the sqrt(hidden) scaling
gives unit-size inputs), every matrix N(0, 1/fan_in), every RMSNorm weight w (q/k norms
included) 0.2 N(0, 1) around 0, the (1 + w) form. Gemma 2's q and k projections are further
multiplied by 3 and its o projection by 2 so the attention logits pass the cap, and its tied
embedding table by 3 so the read-out passes the final cap.

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_gemma_golden.py [--out tests/golden]
"""

import argparse
import json
import os
import shutil

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
)
from transformers.models.gemma2 import modeling_gemma2

import golden_common as gc

VOCAB = 128
SEQ = 100
PROMPT_LEN, NEW_TOKENS = 24, 40
WINDOW = 16

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    attention_bias=False,
    tie_word_embeddings=True,
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    "gemma": (
        GemmaConfig,
        GemmaForCausalLM,
        dict(
            COMMON,
            num_hidden_layers=2,
            num_key_value_heads=1,  # multi-query, as gemma-2b
            hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        3031,
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            COMMON,
            num_hidden_layers=4,
            num_key_value_heads=2,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=10.0,
            final_logit_softcapping=8.0,
        ),
        3032,
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            COMMON,
            num_hidden_layers=7,
            num_key_value_heads=2,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            sliding_window_pattern=6,
        ),
        3033,
    ),
}


def init(name, hidden):
    """Gemma's init of each parameter n of model name (see the module's docstring)."""

    def init_one(n, p, gen):
        if n.endswith("norm.weight"):
            p.copy_(0.2 * gc.randn(p, gen))
        elif n == "model.embed_tokens.weight":
            p.copy_(gc.randn(p, gen) / hidden**0.5)
            if name == "gemma2":
                p.mul_(3.0)  # the tied read-out reaches past the final cap
        else:
            p.copy_(gc.randn(p, gen) / p.shape[-1] ** 0.5)
            if name == "gemma2" and (n.endswith("q_proj.weight") or n.endswith("k_proj.weight")):
                p.mul_(3.0)
            if name == "gemma2" and n.endswith("o_proj.weight"):
                p.mul_(2.0)

    return init_one


def softcap_stats(model, ids):
    """Gemma 2: how far the attention and final logits go past their caps before capping."""
    seen = []
    original = modeling_gemma2.eager_attention_forward

    def spy(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
        k = modeling_gemma2.repeat_kv(key, module.num_key_value_groups)
        raw = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            raw = raw.masked_fill(attention_mask != 0, 0.0)
        seen.append(raw.abs().max().item())
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        softcap=softcap, **kw)

    modeling_gemma2.eager_attention_forward = spy
    try:
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state
            raw_logits = model.lm_head(hidden)[0]
    finally:
        modeling_gemma2.eager_attention_forward = original
    cap = model.config.final_logit_softcapping
    return {
        "attn_logit_softcapping": model.config.attn_logit_softcapping,
        "max_abs_attention_logit_before_cap_per_layer": seen,
        "final_logit_softcapping": cap,
        "max_abs_logit_before_cap": raw_logits.abs().max().item(),
        "fraction_of_logits_beyond_half_the_cap": (raw_logits.abs() > cap / 2).float().mean().item(),
    }


def legacy_form(name, cfg):
    """transformers 5's config.json dict in the transformers 4 form Google's checkpoints have."""

    def rope(v):
        if name == "gemma3":
            full, sliding = dict(v["full_attention"]), dict(v["sliding_attention"])
            return {
                "rope_theta": full.pop("rope_theta"),
                "rope_local_base_freq": sliding.pop("rope_theta"),
                "rope_scaling": full if full.get("rope_type", "default") != "default" else None,
            }
        return {"rope_theta": v["rope_theta"], "rope_scaling": None}

    # Google's config.json files have no layer_types (Gemma 3: sliding_window_pattern)
    out = gc.legacy_form(cfg, rope=rope, skip=("layer_types", "_sliding_window_pattern"))
    if name == "gemma":
        out["hidden_act"] = "gelu"  # as Google wrote it; transformers reads it as the tanh gelu
        out["hidden_activation"] = None
    if name == "gemma2":
        out["hidden_act"] = "gelu_pytorch_tanh"
        out["cache_implementation"] = "hybrid"
    if name == "gemma3":
        out["sliding_window_pattern"] = 6
        out["cache_implementation"] = "hybrid"
    return out


def make(name, out, command):
    config_cls, model_cls, cfg, seed = MODELS[name]
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model = gc.build(config_cls, model_cls, cfg, seed, init(name, cfg["hidden_size"]))
    num_parameters = gc.save_model(model, d)
    del model

    input_ids, prompt = gc.random_inputs(seed, VOCAB, SEQ, PROMPT_LEN)

    # Everything from here on is computed from the saved directory, as a user would load it.
    m = gc.load(model_cls, d)
    config_json = gc.read_config(d)
    logits = gc.logits_of(m, input_ids)
    gen_ids, gen_margin = gc.generate(m, prompt, NEW_TOKENS)
    notes = {}
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
    }
    if name == "gemma2":
        notes["softcaps"] = softcap_stats(m, input_ids)
        m.config.attn_logit_softcapping = None
        m.config.final_logit_softcapping = None
        for layer in m.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = gc.logits_of(m, input_ids)
        tensors["uncapped.logits"] = uncapped
        notes["uncapped vs capped logits (max abs diff / max abs capped)"] = gc.relative_diff(
            uncapped, logits
        )
    del m

    weight_names = gc.weight_names(d)

    legacy = legacy_form(name, config_json)
    gc.write_json(os.path.join(d, "legacy_config.json"), legacy)

    def same_layers(old):
        assert old.config.layer_types == config_json["layer_types"] if "layer_types" in config_json else True

    old_logits = gc.logits_with_config(
        model_cls, d, os.path.join(d, "legacy_config.json"), input_ids,
        files=["model.safetensors"], check=same_layers,
    )
    assert torch.equal(old_logits, logits), "legacy config: other logits"

    tensors = gc.save_tensors(os.path.join(d, "reference.safetensors"), tensors)
    gc.chmod_tree(d)
    sizes = gc.file_sizes(d)
    info = {
        "hf_class": model_cls.__name__,
        "attn_implementation": "eager",
        "config_json": config_json,
        "seed": seed,
        "init": "embeddings N(0, 1/hidden); every other matrix N(0, 1/fan_in) (gemma2: q_proj and "
        "k_proj x 3, o_proj x 2, embeddings x 3); RMSNorm weights w (q_norm, k_norm included) 0.2 N(0, 1), "
        "applied as 1 + w",
        "num_parameters": num_parameters,
        "weights": weight_names,
        "input": {"seq": SEQ, "sliding_window": WINDOW},
        "generate": gc.generate_info(prompt, gen_ids, gen_margin, NEW_TOKENS),
        "max_abs_logit": logits.abs().max().item(),
        "tensors": gc.tensor_list(tensors),
        "notes": notes,
        "file_sizes": sizes,
        "versions": gc.versions(),
        "command": command,
    }
    gc.write_reference_json(os.path.join(d, "reference.json"), info)
    print(f"{d}: {sum(sizes.values())} bytes; {num_parameters} parameters; margin {gen_margin:.4g}; "
          f"max |logit| {logits.abs().max().item():.4g}; {json.dumps(notes)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(gc.repo_root(), "tests", "golden"))
    args = ap.parse_args()
    command = gc.setup("make_gemma_golden.py")
    for name in MODELS:
        make(name, args.out, command)


if __name__ == "__main__":
    main()
