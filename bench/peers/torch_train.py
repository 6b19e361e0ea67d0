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
import statistics
import time

import torch
import torch.nn.functional as F

# The model is torch_gpu.py's (this folder): the same Llama on the CPU and on a GPU.
from torch_gpu import Model


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
    model = Model(dict(vocab=a.vocab, d_model=a.d_model, layers=a.layers, heads=a.heads,
                       kv_heads=a.kv_heads, head_dim=a.head_dim, ffn=a.ffn, seq=a.seq, eps=1e-5,
                       theta=10000.0))
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
