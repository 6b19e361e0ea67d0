#!/usr/bin/env python3
"""Tiny DeepSeek-V2 and DeepSeek-V3 directories written by transformers 5 itself, with reference logits.

Builds two tiny random float32 models with every feature of the architecture on, saves each with
save_pretrained (config.json in the transformers 5 form, experts per expert as save_pretrained
writes them by default) and records what transformers computes for them, under tests/golden/:

  deepseek_v2/  DeepseekV2ForCausalLM: no query compression (q_lora_rank null, as V2-Lite),
                kv_lora_rank 16, qk_nope_head_dim 8, qk_rope_head_dim 8, v_head_dim 12 (values of
                another size than queries and keys); 3 layers, the first dense
                (first_k_dense_replace 1); 8 routed experts of width 16 in 4 groups, top 3 within
                the best 2 groups (group_limited_greedy), 2 shared experts, routed_scaling_factor
                2.0; yarn (factor 4, original context 128) with mscale 1.0 and mscale_all_dim
                0.8 (cos/sin scaled by their ratio, the softmax by mscale_all_dim's square)
  deepseek_v3/  DeepseekV3ForCausalLM: query compression (q_lora_rank 24), the same latent
                attention sizes, 3 layers, the first dense; 8 sigmoid-scored experts in 4 groups,
                top 3 within the best 2, a random e_score_correction_bias N(0, 0.1^2) (it changes
                the choice; weights are the unbiased scores), norm_topk_prob, 1 shared expert,
                routed_scaling_factor 2.5; yarn as above; rope_interleave true

Each directory holds:

  config.json, generation_config.json, model.safetensors   as save_pretrained wrote them
  legacy_config.json    config.json in the transformers 4 form (top-level rope_theta,
                        rope_scaling with the yarn fields, torch_dtype); transformers 5 reads it
                        back to a model with bit-identical logits (checked here)
  reference.safetensors input_ids I32 [1, 100], logits F32 [100, 128] (eager attention, CPU, one
                        thread), generate.prompt I32 [1, 8] and generate.ids I32 [1, 28] (greedy
                        generate, do_sample=False, 20 new tokens: the prompt and the new tokens),
                        loss F32 [1] (mean next-token cross-entropy over the 100 tokens) and
                        grad.<weight name> of every weight (experts per expert)
  reference.json        the config, seeds, init, smallest top-1/top-2 logit gap of the generate
                        run, versions and the command

deepseek_v3/ further holds configs of other models with the same weights, and their logits in
reference.safetensors:
  rotate_half_config.json   rope_interleave false (rotate_half pairs)   rotate_half.logits
  no_norm_topk_config.json  norm_topk_prob false                        no_norm_topk.logits

Weights are scaled like a trained model's, not HF's N(0, 0.02) init: embeddings N(0, 1), every
matrix N(0, 1/fan_in) (router and experts too, so routing is decisive), every RMSNorm gain
1 + 0.1 N(0, 1).

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_deepseek_golden.py [--out tests/golden]
"""

import argparse
import copy
import os
import shutil

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

import golden_common as gc

VOCAB = 128
SEQ = 100
PROMPT_LEN, NEW_TOKENS = 8, 20

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    rope_parameters=YARN,
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    "deepseek_v2": (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        dict(
            COMMON,
            q_lora_rank=None,
            topk_method="group_limited_greedy",
            n_shared_experts=2,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
        ),
        3031,
    ),
    "deepseek_v3": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(
            COMMON,
            q_lora_rank=24,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            num_mtp_layers=0,
        ),
        3032,
    ),
}

VARIANTS = {
    "deepseek_v3": {
        "rotate_half": {"rope_interleave": False},
        "no_norm_topk": {"norm_topk_prob": False},
    }
}


def init_buffers(model, gen):
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def loss_and_grads(model, ids):
    """Mean next-token cross-entropy over the sequence and every parameter's gradient, under the
    names save_pretrained gives the weights (the experts' fused in-memory gate_up_proj and
    down_proj split into per-expert [out, in] matrices)."""
    model.zero_grad()
    logits = model(input_ids=ids).logits[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = g.shape[1] // 2
            for e in range(g.shape[0]):
                grads[f"grad.{base}{e}.gate_proj.weight"] = g[e, :half]
                grads[f"grad.{base}{e}.up_proj.weight"] = g[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                grads[f"grad.{base}{e}.down_proj.weight"] = g[e]
        else:
            grads["grad." + name] = g
    model.zero_grad()
    return loss.item(), grads


def legacy_rope(v):
    """DeepSeek's transformers 4 rope_scaling names the type "type"."""
    rope = dict(v)
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    return {"rope_theta": theta, "rope_scaling": rope if rope["type"] != "default" else None}


def make(name, out, command):
    config_cls, model_cls, cfg, seed = MODELS[name]
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model = gc.build(config_cls, model_cls, cfg, seed, after=init_buffers)
    num_parameters = gc.save_model(model, d)
    del model

    input_ids, prompt = gc.random_inputs(seed, VOCAB, SEQ, PROMPT_LEN)

    # Everything from here on is computed from the saved directory, as a user would load it.
    m = gc.load(model_cls, d)
    config_json = gc.read_config(d)
    logits = gc.logits_of(m, input_ids)
    gen_ids, gen_margin = gc.generate(m, prompt, NEW_TOKENS)
    loss, grads = loss_and_grads(m, input_ids)
    del m

    weight_names = gc.weight_names(d)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in weight_names), weight_names
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
        "loss": torch.tensor([loss], dtype=torch.float32),
    }
    tensors.update(grads)

    legacy = gc.legacy_form(config_json, rope=legacy_rope)
    gc.write_json(os.path.join(d, "legacy_config.json"), legacy)
    notes = {}
    weights = ["model.safetensors"]
    old_logits = gc.logits_with_config(
        model_cls, d, os.path.join(d, "legacy_config.json"), input_ids, files=weights
    )
    assert torch.equal(old_logits, logits), "legacy config: other logits"
    for vname, change in VARIANTS.get(name, {}).items():
        variant = copy.deepcopy(config_json)
        variant.update(change)
        variant_path = os.path.join(d, vname + "_config.json")
        gc.write_json(variant_path, variant)

        def check(vm, change=change):
            for k, v in change.items():
                assert getattr(vm.config, k) == v, (k, getattr(vm.config, k))

        tensors[vname + ".logits"] = gc.logits_with_config(
            model_cls, d, variant_path, input_ids, files=weights, check=check
        )
        notes[vname + ".logits vs logits (max abs / max abs)"] = gc.relative_diff(
            tensors[vname + ".logits"], logits
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
        "too); RMSNorm gains 1 + 0.1 N(0, 1); e_score_correction_bias 0.1 N(0, 1)",
        "num_parameters": num_parameters,
        "weights": weight_names,
        "input": {"seq": SEQ},
        "generate": gc.generate_info(prompt, gen_ids, gen_margin, NEW_TOKENS),
        "max_abs_logit": logits.abs().max().item(),
        "tensors": gc.tensor_list(tensors),
        "notes": notes,
        "file_sizes": sizes,
        "versions": gc.versions(),
        "command": command,
    }
    gc.write_reference_json(os.path.join(d, "reference.json"), info)
    print(f"{d}: {sum(sizes.values())} bytes; {num_parameters} parameters; margin {gen_margin:.4g}; {notes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(gc.repo_root(), "tests", "golden"))
    args = ap.parse_args()
    command = gc.setup("make_deepseek_golden.py")
    for name in MODELS:
        make(name, args.out, command)


if __name__ == "__main__":
    main()
