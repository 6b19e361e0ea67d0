#!/usr/bin/env python3
"""PyTorch peer of `mt bench train --model=mixtral-bench-100m`: the same Mixtral architecture,
optimizer, shapes and thread count, float32 on the CPU; prints one JSON object with the fields of
mt's (median step time after the warm-up steps).

The model (read from configs/models/<model>.yml, as mt reads it): pre-norm layers of GQA attention
with rotary embeddings (F.scaled_dot_product_attention, causal, enable_gqa) and a dropless
mixture-of-experts SwiGLU MLP: softmax router, top k, weights renormalised (norm_topk_prob),
expert weights stacked [E, in, out] as mt stores them, and MaxText's load-balancing loss (weight
load_balance_loss_weight, per sequence) added to the cross-entropy, as mt trains it. mt also
evaluates the router z-loss at weight 0 (moe_z_loss_weight); the peer leaves it out.

The experts run in one of two forms (--moe_form):
  grouped_mm  (default) the token copies sorted by expert (a stable argsort of the top-k indices),
              gathered with index_select, one torch.nn.functional.grouped_mm (torch >= 2.9,
              differentiable, CPU f32 supported) per projection with the experts' row offsets,
              and the weighted outputs summed back per token with index_add_: the MegaBlocks
              form mt uses, with no Python loop over experts.
  loop        the same sort and gather, then the sorted rows split per expert and a Python loop
              of three matmuls per expert (the fallback where grouped_mm does not exist).
AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on every matrix and expert stack,
none on norms), global gradient-norm clipping at 1.0, as mt's base.yml.

FLOPs per token use mt's formula (active parameters only): 6 x matmul parameters (attention,
router, k/E of the expert stacks, LM head; embedding lookup excluded) + 6 x layers x heads x
head_dim x seq (causal attention).
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# Shared with the dense peers (this folder): norms, rotary tables, attention, config reading.
from torch_gpu import RMSNorm, attend, read_config, rope_tables, rotate


def grouped_mm_available():
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    try:
        mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        # (strides must be multiples of 16 bytes; a broadcast gradient is refused)
        x = torch.randn(8, 8, requires_grad=True)
        w = torch.randn(2, 8, 8, requires_grad=True)
        y = mm(x, w, offs=torch.tensor([1, 8], dtype=torch.int32))
        y.backward(torch.randn_like(y))
        ref = torch.cat([x[:1] @ w[0], x[1:] @ w[1]])
        return bool(torch.allclose(y, ref, atol=1e-5))
    except Exception:  # not on this device / dtype / version
        return False


class MoE(torch.nn.Module):
    def __init__(self, c, form):
        super().__init__()
        d, h, E = c["d_model"], c["moe_ffn"], c["experts"]
        self.E, self.k, self.norm_topk, self.form = E, c["top_k"], c["norm_topk"], form
        self.router = torch.nn.Linear(d, E, bias=False)
        self.w_gate = torch.nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.w_up = torch.nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.w_down = torch.nn.Parameter(torch.randn(E, h, d) * 0.02)
        self.mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

    def forward(self, x):
        B, T, d = x.shape
        n, E, k = B * T, self.E, self.k
        x2 = x.reshape(n, d)
        probs = self.router(x2).softmax(-1)  # [n, E]
        w, idx = probs.topk(k, -1)  # [n, k]
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # token copies by expert, token order within one
        counts = torch.bincount(flat, minlength=E)
        tok = order // k
        xs = x2.index_select(0, tok)  # [n k, d]
        if self.form == "grouped_mm":
            offs = counts.cumsum(0).to(torch.int32)
            hs = F.silu(self.mm(xs, self.w_gate, offs=offs)) * self.mm(xs, self.w_up, offs=offs)
            ys = self.mm(hs, self.w_down, offs=offs)
        else:
            parts = []
            for e, xe in enumerate(xs.split(counts.tolist())):
                if xe.shape[0]:
                    parts.append((F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e])
            ys = torch.cat(parts)
        ys = ys * w.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x2).index_add_(0, tok, ys)
        # MaxText's load balancing: E / B * sum_b sum_e f_be P_be, f_be = (slots of b to e) / T.
        f = torch.zeros(B, E).scatter_add_(1, idx.reshape(B, T * k),
                                           torch.ones(B, T * k)) / T
        lb = E / B * (f * probs.reshape(B, T, E).mean(1)).sum()
        return out.reshape(B, T, d), lb


class Layer(torch.nn.Module):
    def __init__(self, c, form):
        super().__init__()
        d, hd = c["d_model"], c["head_dim"]
        self.c = c
        self.n1, self.n2 = RMSNorm(d, c["eps"]), RMSNorm(d, c["eps"])
        self.wq = torch.nn.Linear(d, c["heads"] * hd, bias=False)
        self.wk = torch.nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.wv = torch.nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.wo = torch.nn.Linear(c["heads"] * hd, d, bias=False)
        self.moe = MoE(c, form)

    def forward(self, x, cos, sin):
        c = self.c
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(b, t, c["heads"], c["head_dim"]).transpose(1, 2)
        k = self.wk(h).view(b, t, c["kv_heads"], c["head_dim"]).transpose(1, 2)
        v = self.wv(h).view(b, t, c["kv_heads"], c["head_dim"]).transpose(1, 2)
        o = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        y, lb = self.moe(self.n2(x))
        return x + y, lb


class Model(torch.nn.Module):
    def __init__(self, c, form):
        super().__init__()
        self.emb = torch.nn.Embedding(c["vocab"], c["d_model"])
        self.layers = torch.nn.ModuleList(Layer(c, form) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["d_model"], c["eps"])
        self.head = torch.nn.Linear(c["d_model"], c["vocab"], bias=False)
        cos, sin = rope_tables(c["seq"], c["head_dim"], c["theta"])
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, ids):
        x = self.emb(ids)
        lb = 0.0
        for layer in self.layers:
            x, l = layer(x, self.cos, self.sin)
            lb = lb + l
        return self.head(self.norm(x)), lb


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mixtral-bench-100m")
    p.add_argument("--moe_form", choices=["grouped_mm", "loop"], default=None,
                   help="default: grouped_mm where this torch has it on the CPU, else loop")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak_tflops", type=float, default=0.0,
                   help="peak for MFU (the script passes mt's CPU peak); 0 = no MFU")
    a = p.parse_args()
    cfg = read_config(a.model)
    c = {"vocab": cfg["vocab_size"], "d_model": cfg["base_emb_dim"],
         "heads": cfg["base_num_query_heads"], "kv_heads": cfg["base_num_kv_heads"],
         "head_dim": cfg["head_dim"],
         "moe_ffn": int(cfg.get("base_moe_mlp_dim", 0)) or cfg["base_mlp_dim"],
         "experts": cfg["num_experts"], "top_k": cfg["num_experts_per_tok"],
         "norm_topk": str(cfg.get("norm_topk_prob", "false")).lower() == "true",
         "lb_weight": float(cfg.get("load_balance_loss_weight", 0.01)),
         "layers": cfg["base_num_decoder_layers"],
         "seq": a.seq or cfg.get("max_target_length", 512),
         "batch": a.batch or cfg.get("per_device_batch_size", 4),
         "eps": float(cfg.get("normalization_layer_epsilon", 1e-5)),
         "theta": float(cfg.get("rope_max_timescale", 10000.0))}
    if cfg.get("capacity_factor", -1) > 0 or cfg.get("sliding_window_size", 0):
        raise SystemExit("torch_moe_train.py: only dropless MoE without a sliding window")
    form = a.moe_form or ("grouped_mm" if grouped_mm_available() else "loop")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Model(c, form)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    active = c["top_k"] / c["experts"]
    matmul_params = 0.0
    for n, q in model.named_parameters():
        if n.startswith("emb.") or q.ndim < 2:
            continue
        matmul_params += q.numel() * (active if q.ndim == 3 else 1.0)
    total_params = sum(q.numel() for q in model.parameters())
    flops_per_token = int(6 * matmul_params + 6 * c["layers"] * c["heads"] * c["head_dim"] * c["seq"])
    times, loss = [], float("nan")
    for _ in range(a.steps):
        ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1))
        t0 = time.perf_counter()
        logits, lb = model(ids[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, c["vocab"]), ids[:, 1:].reshape(-1))
        l = ce + c["lb_weight"] * lb
        opt.zero_grad(set_to_none=True)
        l.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = ce.item()
        del logits, lb, ce, l
    dt = statistics.median(times[a.skip:] if len(times) > a.skip else times)
    tps = c["batch"] * c["seq"] / dt
    print(json.dumps({
        "bench": "train", "peer": "pytorch", "model": a.model, "torch": torch.__version__,
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "moe_form": form, "num_threads": a.threads, "batch": c["batch"], "seq": c["seq"],
        "steps": a.steps, "dtype": "float32", "params": total_params,
        "active_matmul_params": int(matmul_params),
        "tokens_per_sec": round(tps, 2),
        "model_tflops_per_sec": round(tps * flops_per_token / 1e12, 5),
        "mfu": round(tps * flops_per_token / (a.peak_tflops * 1e12), 5) if a.peak_tflops else None,
        "step_time_ms": round(dt * 1e3, 1), "final_loss": round(loss, 4),
        "flops_per_token": flops_per_token}))


if __name__ == "__main__":
    main()
