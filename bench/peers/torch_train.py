#!/usr/bin/env python3
"""PyTorch peer of `mt bench train`: the same Llama architecture, optimizer and shapes, float32,
the same thread count; prints one JSON object with the same fields (medians after warm-up).

Defaults are configuration M (vocab 32000, d_model 768, 12 layers, 12 heads, 12 kv heads,
ffn 2048, seq 512, batch 4). FLOPs per token use mt's formula (DESIGN.md): 6 x matmul
parameters (LM head included, embedding lookup excluded) + 6 x layers x heads x head_dim x seq
(attention, causal).
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def rope_tables(seq, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def rotate(x, cos, sin):  # x [B, H, T, D], rotate_half pairing (Hugging Face Llama)
    h = x.shape[-1] // 2
    r = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + r * sin


class Layer(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        d, hd = a.d_model, a.head_dim
        self.a = a
        self.n1, self.n2 = RMSNorm(d, 1e-5), RMSNorm(d, 1e-5)
        self.wq = torch.nn.Linear(d, a.heads * hd, bias=False)
        self.wk = torch.nn.Linear(d, a.kv_heads * hd, bias=False)
        self.wv = torch.nn.Linear(d, a.kv_heads * hd, bias=False)
        self.wo = torch.nn.Linear(a.heads * hd, d, bias=False)
        self.wg = torch.nn.Linear(d, a.ffn, bias=False)
        self.wu = torch.nn.Linear(d, a.ffn, bias=False)
        self.wd = torch.nn.Linear(a.ffn, d, bias=False)

    def forward(self, x, cos, sin):
        a = self.a
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(b, t, a.heads, a.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if a.kv_heads != a.heads:
            k = k.repeat_interleave(a.heads // a.kv_heads, 1)
            v = v.repeat_interleave(a.heads // a.kv_heads, 1)
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13 (Debian 12): explicit causal attention
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(a.head_dim))
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            o = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        return x + self.wd(F.silu(self.wg(h)) * self.wu(h))


class Model(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = torch.nn.Embedding(a.vocab, a.d_model)
        self.layers = torch.nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.d_model, 1e-5)
        self.head = torch.nn.Linear(a.d_model, a.vocab, bias=False)
        cos, sin = rope_tables(a.seq, a.head_dim, 10000.0)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x, self.cos, self.sin)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv_heads", type=int, default=12)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Model(a)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    matmul_params = sum(p.numel() for n, p in model.named_parameters()
                        if p.ndim == 2 and not n.startswith("emb."))
    flops_per_token = 6 * matmul_params + 6 * a.layers * a.heads * a.head_dim * a.seq
    times, loss = [], float("nan")
    for step in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        l = F.cross_entropy(logits.reshape(-1, a.vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        l.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = l.item()
    dt = statistics.median(times[2:] if len(times) > 2 else times)
    tps = a.batch * a.seq / dt
    print(json.dumps({
        "bench": "train", "peer": "pytorch", "torch": torch.__version__,
        "num_threads": a.threads, "batch": a.batch, "seq": a.seq, "steps": a.steps,
        "tokens_per_sec": round(tps, 2),
        "model_tflops_per_sec": round(tps * flops_per_token / 1e12, 5),
        "step_time_ms": round(dt * 1e3, 1), "final_loss": round(loss, 4),
        "flops_per_token": flops_per_token}))


if __name__ == "__main__":
    main()
