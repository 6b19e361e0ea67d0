#!/usr/bin/env python3
"""PyTorch peer of `mt bench train --model=gpt2`: GPT-2 124M written plainly in PyTorch (the
fastest eager form on the CPU: nn.Linear GEMMs through MKL, fused q/k/v projection,
F.scaled_dot_product_attention with is_causal, tanh-approximate gelu, LayerNorm, the LM head
tied to the token embedding), float32, the same optimizer as mt's defaults (fused AdamW, lr 3e-4,
betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices, global-norm clipping at 1.0), random
tokens, the same thread count; prints one JSON object with the fields of `mt bench train`
(medians after two warm-up steps).

FLOPs per token use mt's formula: 6 x matmul parameters (the tied embedding counts once, as the
LM head; the position table is a lookup) + 6 x layers x heads x head_dim x seq (causal attention).
--compile runs the model under torch.compile (inductor) instead of eagerly.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab, positions, layers, heads, c):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(positions, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied LM head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT2(a.vocab, a.positions, a.layers, a.heads, a.d_model)
    fwd = torch.compile(model) if a.compile else model
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    matmul_params = sum(p.numel() for n, p in model.named_parameters()
                        if p.ndim == 2 and not n.startswith("wpe."))
    d = a.d_model // a.heads
    flops_per_token = 6 * matmul_params + 6 * a.layers * a.heads * d * a.seq
    times, loss = [], float("nan")
    for step in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
        t0 = time.perf_counter()
        logits = fwd(ids[:, :-1])
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
        "bench": "train", "peer": "pytorch" + ("-compile" if a.compile else ""),
        "torch": torch.__version__, "num_threads": a.threads, "batch": a.batch, "seq": a.seq,
        "steps": a.steps, "tokens_per_sec": round(tps, 2),
        "model_tflops_per_sec": round(tps * flops_per_token / 1e12, 5),
        "step_time_ms": round(dt * 1e3, 1), "final_loss": round(loss, 4),
        "flops_per_token": flops_per_token}))


if __name__ == "__main__":
    main()
