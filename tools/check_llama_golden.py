#!/usr/bin/env python3
"""Checks tests/golden/<name>.safetensors against a from-scratch NumPy Llama forward pass.

A second, independent reading of the architecture (written from the Llama papers' equations,
not from transformers' code): RMSNorm, rotate-half RoPE with optional Llama 3.1 frequency
scaling, grouped-query causal attention, SwiGLU, tied or untied output embedding. It recomputes
the logits and the loss in float64 from the stored weights and compares them with what
transformers produced, so a bug on either side of mt's golden test shows up here first. It also
serves as a compact executable statement of what mt's Llama must compute.

Needs only numpy and safetensors:
    python3 tools/check_llama_golden.py [--golden tests/golden]
"""

import argparse
import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_frequencies(cfg, head_dim):
    theta = cfg["rope_theta"]
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        orig = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - lo) / (hi - lo)
        scaled = np.where(
            wavelen > orig / lo,  # low frequencies: slowed down by the factor
            inv / factor,
            np.where(wavelen < orig / hi, inv, (1 - smooth) * inv / factor + smooth * inv),
        )
        inv = scaled
    elif rs:
        raise SystemExit(f"unsupported rope_scaling {rs}")
    return inv


def rope(x, positions, inv):
    # x [B, T, H, D]; pairs feature i with i + D/2 ("rotate half").
    ang = positions[:, :, None] * inv[None, None, :]  # [B, T, D/2]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def forward(w, cfg, ids):
    B, T = ids.shape
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]
    inv = inv_frequencies(cfg, D)
    pos = np.broadcast_to(np.arange(T, dtype=np.float64), (B, T))
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, D)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, KV, D)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, KV, D)
        q, k = rope(q, pos, inv), rope(k, pos, inv)
        rep = H // KV  # query head j reads key/value head j // rep
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        s = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", s, v).reshape(B, T, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def loss_of(logits, ids):
    z = logits[:, :-1, :]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    tgt = np.take_along_axis(z, ids[:, 1:, None], -1)[..., 0]
    return float(np.mean(lse - tgt))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--golden", default=os.path.normpath(os.path.join(here, "..", "tests", "golden")))
    args = ap.parse_args()
    ok = True
    for name in ("llama_gqa", "llama31"):
        t = load_file(os.path.join(args.golden, name + ".safetensors"))
        with open(os.path.join(args.golden, name + ".json")) as f:
            info = json.load(f)
        w = {k: v.astype(np.float64) for k, v in t.items() if v.dtype == np.float32}
        ids = t["input_ids"].astype(np.int64)
        logits = forward(w, info["config"], ids)
        ref = t["logits"].astype(np.float64)
        err = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
        loss = loss_of(logits, ids)
        lerr = abs(loss - info["loss"]) / abs(info["loss"])
        # Greedy decoding from the prompt, recomputing the whole prefix each step.
        seq = t["generate_prompt"].astype(np.int64)
        for _ in range(info["generate"]["max_new_tokens"]):
            nxt = forward(w, info["config"], seq)[:, -1, :].argmax(-1)
            seq = np.concatenate([seq, nxt[:, None]], 1)
        gen_ok = seq[0].tolist() == t["generate_ids"][0].tolist()
        # Gradients: central differences of the float64 loss at a few elements of each matrix
        # kind, against the stored float32 autograd gradients.
        rng = np.random.default_rng(0)
        gerr = 0.0
        for pname in sorted(k for k in w if not k.startswith("grad.")):
            if not (pname.endswith("norm.weight") or "layers.1." in pname or "embed" in pname):
                continue
            grad = t["grad." + pname].astype(np.float64)
            for _ in range(2):
                idx = tuple(int(rng.integers(0, d)) for d in grad.shape)
                if "embed" in pname:  # pick a row that the batch uses, so the gradient is nonzero
                    idx = (int(ids[0, 3]),) + idx[1:]
                h = 1e-5
                old = w[pname][idx]
                w[pname][idx] = old + h
                up = loss_of(forward(w, info["config"], ids), ids)
                w[pname][idx] = old - h
                down = loss_of(forward(w, info["config"], ids), ids)
                w[pname][idx] = old
                fd = (up - down) / (2 * h)
                gerr = max(gerr, abs(fd - grad[idx]) / max(abs(grad[idx]), 1e-4))
        good = err < 1e-5 and lerr < 1e-6 and gen_ok and gerr < 1e-3
        ok &= good
        print(
            f"{name}: logits max err / max |logit| {err:.2e}, loss {loss!r} vs {info['loss']!r} "
            f"(rel {lerr:.1e}), gradients vs finite differences {gerr:.1e}, "
            f"generate {'matches' if gen_ok else 'DIFFERS'}: "
            f"{'ok' if good else 'MISMATCH'}"
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
