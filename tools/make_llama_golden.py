#!/usr/bin/env python3
"""Reference data for mt's Llama implementation, made by an independent one (Hugging Face).

Builds two tiny LlamaForCausalLM models from random configs with fixed seeds, runs a fixed batch
through them and writes, for each model, tests/golden/<name>.safetensors and <name>.json:

  safetensors: every parameter under its Hugging Face name (for the tied model, lm_head.weight is
               absent as in save_pretrained: it is model.embed_tokens.weight), then
               input_ids        I32 [2, 16]     the batch
               logits           F32 [2, 16, 256]
               grad.<param>     F32             d loss / d param for every parameter
               generate_prompt  I32 [1, 5]      prompt for greedy decoding
               generate_ids     I32 [1, 15]     model.generate(prompt, max_new_tokens=10,
                                                do_sample=False): the prompt followed by 10 tokens
  json:        config, loss, what the loss averages over, versions, the command, and for the
               greedy decode the smallest gap between the best and second-best logit (how robust
               an exact-match test of generate_ids is to float rounding).

The loss is HF's causal LM loss with labels = input_ids: logits at positions t = 0..14 predict
input_ids at t + 1, averaged (mean cross-entropy) over all 2 x 15 = 30 positions; position 15 of
each sequence predicts nothing. The script recomputes it by hand and checks that both agree.

Run from the repository root (float32 on the CPU, deterministic):
    python3 tools/make_llama_golden.py [--out tests/golden]
"""

import argparse
import json
import os
import re
import shlex
import sys

import torch
import transformers
import safetensors
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
BATCH, SEQ = 2, 16
PROMPT_LEN, NEW_TOKENS = 5, 10

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    torch_dtype="float32",
)

ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "attention_dropout",
    "mlp_bias", "initializer_range", "pretraining_tp", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id",
)

MODELS = {
    "llama_gqa": dict(
        COMMON, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, seed=1234
    ),
    "llama31": dict(
        COMMON,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        seed=5678,
    ),
}


def build(spec):
    spec = dict(spec)
    seed = spec.pop("seed")
    torch.manual_seed(seed)
    config = LlamaConfig(**spec)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).to(torch.float32)
    # Re-initialise explicitly so the data do not depend on HF's init details: N(0, 0.02) for
    # every matrix, and random RMSNorm gains 1 + 0.1 N(0, 1) so a wrong norm shows up.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model.eval()  # no dropout (attention_dropout is 0 anyway)
    return model, seed


def make(name, spec, out_dir, command):
    model, seed = build(spec)
    gen = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)

    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    logits = out.logits.detach()

    # The same loss by hand, to pin down exactly which positions count.
    logp = torch.log_softmax(logits.double(), dim=-1)
    targets = input_ids[:, 1:]
    manual = -logp[:, :-1, :].gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean().item()
    assert abs(manual - out.loss.item()) < 1e-5, (manual, out.loss.item())

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
    generate_ids = g.sequences
    assert generate_ids.shape == (1, PROMPT_LEN + NEW_TOKENS), generate_ids.shape
    margins = []
    for s in g.scores:
        top2 = torch.topk(s[0].float(), 2).values
        margins.append((top2[0] - top2[1]).item())

    tensors = {}
    for pname, p in model.named_parameters():
        tensors[pname] = p.detach().contiguous()
        tensors["grad." + pname] = p.grad.detach().contiguous()
    tensors["input_ids"] = input_ids.to(torch.int32).contiguous()
    tensors["logits"] = logits.contiguous()
    tensors["generate_prompt"] = prompt.to(torch.int32).contiguous()
    tensors["generate_ids"] = generate_ids.to(torch.int32).contiguous()
    st_path = os.path.join(out_dir, name + ".safetensors")
    save_file(tensors, st_path, metadata={"format": "pt", "model": name})
    os.chmod(st_path, 0o644)  # the library creates it private

    full = model.config.to_dict()
    # The architecture fields, all spelled out (config.json's diff form would omit defaults such
    # as rope_theta 10000, and readers of this file should not need transformers' defaults).
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    cfg.update({k: full[k] for k in ARCH_KEYS if k in full})
    info = {
        "name": name,
        "hf_class": "LlamaForCausalLM",
        "config": cfg,
        "seed": seed,
        "loss": float(out.loss.item()),
        "loss_float64_from_logits": manual,
        "loss_definition": (
            "mean cross-entropy over all %d x %d positions (b, t), t = 0..%d: "
            "-log softmax(logits[b, t])[input_ids[b, t + 1]]; position %d predicts nothing"
            % (BATCH, SEQ - 1, SEQ - 2, SEQ - 1)
        ),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings")),
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "generate": {
            "prompt": prompt[0].tolist(),
            "ids": generate_ids[0].tolist(),
            "max_new_tokens": NEW_TOKENS,
            "do_sample": False,
            "min_top1_top2_logit_margin": min(margins),
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "python": sys.version.split()[0],
        },
        "command": command,
        "tensors": {
            k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()
        },
    }
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        text = json.dumps(info, indent=2)
        # Keep lists of numbers on one line.
        text = re.sub(
            r"\[\s*([-0-9.e,\s]+?)\s*\]",
            lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
            text,
        )
        f.write(text + "\n")
    size = os.path.getsize(st_path)
    print(
        f"{name}: loss {info['loss']!r}, {info['num_parameters']} parameters, "
        f"{st_path} ({size} bytes), generate {info['generate']['ids']} "
        f"(min margin {info['generate']['min_top1_top2_logit_margin']:.4g})"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument(
        "--out", default=os.path.normpath(os.path.join(here, "..", "tests", "golden"))
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)  # one thread: reductions in a fixed order
    torch.use_deterministic_algorithms(True)
    command = "python3 tools/make_llama_golden.py" + "".join(
        " " + shlex.quote(a) for a in sys.argv[1:]
    )
    for name, spec in MODELS.items():
        make(name, spec, args.out, command)


if __name__ == "__main__":
    main()
