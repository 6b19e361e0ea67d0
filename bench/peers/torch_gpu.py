#!/usr/bin/env python3
"""PyTorch peer of `mt bench gemm`, `mt bench attention` and `mt bench train` on a GPU.

Each subcommand prints one JSON line per case with the field names of the mt side, so
bench/gpu/run.sh can join the two by shape; defaults are the same cases as mt's:
  gemm       c[M, N] = a[M, K] @ b[K, N] with torch.matmul (out= a preallocated c), bf16 in and
             out (cuBLAS accumulates in f32); shapes: the projections of llama2-7b and
             llama-bench-1b for 8192 tokens, read from configs/models (llama-bench-m, 256 tokens,
             on the CPU).
  attention  F.scaled_dot_product_attention forward and forward+backward, q/k/v stored
             [B, T, H, D] as mt stores them; mt's `flash` runs against SDPA's flash backend and
             `dot_product` against its math backend (both materialise nothing / everything alike).
  train      the Llama of bench/peers/torch_train.py (same architecture, AdamW, clipping and
             FLOPs formula) with f32 master weights under bf16 autocast; --compile for the
             torch.compile'd variant.
Timing as on the mt side: warm-up calls, then repeats of `iters` calls between two
synchronizations; the median of the repeats. FLOPs: 2MKN per product; attention forward
4 B T S H D, forward+backward three times that (DESIGN.md's model FLOPs), halved when causal;
training 6 x matmul parameters (LM head included) + 6 x layers x heads x head_dim x seq per token.
"""
import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- shared -------------------------------------------------------------------------------------

def device_of(a):
    if a.device:
        return torch.device(a.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timing_defaults(a, dev):
    cpu = dev.type == "cpu"
    a.warmup = (1 if cpu else 5) if a.warmup is None else a.warmup
    a.iters = (2 if cpu else 10) if a.iters is None else a.iters
    a.repeats = (3 if cpu else 5) if a.repeats is None else a.repeats


def median_ms(fn, dev, a):
    for _ in range(a.warmup):
        fn()
    sync(dev)
    ms = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        sync(dev)
        ms.append((time.perf_counter() - t0) * 1e3 / a.iters)
    return statistics.median(ms)


def peak_tflops(a, dev):
    """The peak mt's cuda backend reports (H100/H200 dense bf16), unless given."""
    if a.peak_tflops is not None:
        return a.peak_tflops
    if dev.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(dev)
    return 989.0 if ("H100" in name or "H200" in name) else 0.0


def emit(fields, a, dev):
    fields.update({"peer": "pytorch", "torch": torch.__version__})
    if dev.type == "cuda":
        fields["device"] = torch.cuda.get_device_name(dev)
    print(json.dumps(fields), flush=True)


def fail(fields, e, a, dev):
    msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    print(f"torch_gpu.py {fields['bench']}: {fields.get('name')} failed: {msg}", file=sys.stderr)
    fields["error"] = msg
    emit(fields, a, dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def read_config(model):
    """configs/base.yml overlaid with configs/models/<model>.yml (or a path): scalar keys only."""
    def scalars(path):
        out = {}
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].rstrip()
            if not line or line.startswith(" ") or ":" not in line:
                continue
            k, v = (s.strip() for s in line.split(":", 1))
            v = v.strip('"').strip("'")
            try:
                out[k] = int(v)
            except ValueError:
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v
        return out
    path = Path(model)
    if not model.endswith((".yml", ".yaml")):
        path = ROOT / "configs/models" / f"{model}.yml"
    if not path.exists():
        raise SystemExit(f"torch_gpu.py: no model config {path}.")
    c = scalars(ROOT / "configs/base.yml")
    c.update(scalars(path))
    return c


def parse_shapes(text, form):
    shapes = []
    for item in text.split(","):
        dims = item.split("x")
        if len(dims) != len(form.split("x")) or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise SystemExit(f"torch_gpu.py: --shapes {text} must be a comma-separated list of "
                             f"{form}; '{item}' is not.")
        shapes.append([int(d) for d in dims])
    return shapes


def random(shape, dtype, dev, bound=1.0):
    return torch.empty(shape, dtype=torch.float32, device=dev).uniform_(-bound, bound).to(dtype)


# ---- gemm ---------------------------------------------------------------------------------------

def model_gemms(model, tokens):
    """The same cases, names included, as mt's model_gemms (core/cli/cmd_bench.cpp)."""
    c = read_config(model)
    d, f, v = c["base_emb_dim"], c["base_mlp_dim"], c["vocab_size"]
    q = c["base_num_query_heads"] * c["head_dim"]
    kv = c["base_num_kv_heads"] * c["head_dim"]
    cases = [(f"{model}.attn", tokens, d, q)]
    if q != d:
        cases.append((f"{model}.attn_out", tokens, q, d))
    if kv != q:
        cases.append((f"{model}.attn_kv", tokens, d, kv))
    cases += [(f"{model}.mlp_up", tokens, d, f), (f"{model}.mlp_down", tokens, f, d),
              (f"{model}.lm_head", tokens, d, v)]
    return cases


def cmd_gemm(a):
    dev = device_of(a)
    timing_defaults(a, dev)
    dt = DTYPES[a.dtype]
    cpu = dev.type == "cpu"
    if a.shapes:
        cases = [(f"{m}x{k}x{n}", m, k, n) for m, k, n in parse_shapes(a.shapes, "MxKxN")]
    else:
        tokens = a.tokens or (256 if cpu else 8192)
        models = ["llama-bench-m"] if cpu else ["llama2-7b", "llama-bench-1b"]
        if a.model:
            models = [a.model]
        cases = [c for m in models for c in model_gemms(m, tokens)]
    peak = peak_tflops(a, dev)
    failed = 0
    for name, m, k, n in cases:
        fields = {"bench": "gemm", "name": name, "backend": dev.type, "M": m, "K": k, "N": n,
                  "trans_a": a.trans_a, "trans_b": a.trans_b, "dtype": a.dtype}
        try:
            # Stored as mt stores them: a [K, M] when trans_a, b [N, K] when trans_b.
            x = random((k, m) if a.trans_a else (m, k), dt, dev)
            w = random((n, k) if a.trans_b else (k, n), dt, dev)
            xa = x.t() if a.trans_a else x
            wb = w.t() if a.trans_b else w
            out = torch.empty((m, n), dtype=dt, device=dev)
            ms = median_ms(lambda: torch.matmul(xa, wb, out=out), dev, a)
            tflops = 2.0 * m * k * n / (ms * 1e-3) / 1e12
            fields.update({"median_ms": round(ms, 4), "tflops": round(tflops, 4),
                           "peak_tflops": peak})
            emit(fields, a, dev)
            del x, w, xa, wb, out
        except Exception as e:  # one case's failure (e.g. out of memory) must not stop the rest
            failed += 1
            fail(fields, e, a, dev)
    return 1 if failed else 0


# ---- attention ----------------------------------------------------------------------------------

def sdpa_backend(kernel):
    """A context that restricts SDPA to the backend matching mt's kernel, and its name."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if kernel == "flash":
            return sdpa_kernel(SDPBackend.FLASH_ATTENTION), "flash"
        return sdpa_kernel(SDPBackend.MATH), "math"
    except ImportError:
        pass
    if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0
        return contextlib.nullcontext(), "explicit"
    flash = kernel == "flash"
    try:  # torch 2.0 - 2.2
        return (torch.backends.cuda.sdp_kernel(enable_flash=flash, enable_math=not flash,
                                               enable_mem_efficient=False),
                "flash" if flash else "math")
    except (AttributeError, TypeError):
        return contextlib.nullcontext(), "default"


def attend(q, k, v, causal):
    """q [B, H, T, D], k and v [B, Hkv, S, D] -> [B, H, T, D]."""
    groups = q.shape[1] // k.shape[1]
    if hasattr(F, "scaled_dot_product_attention"):
        if groups > 1:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            except TypeError:  # torch < 2.5
                pass
        else:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    # torch 1.13: the explicit product (what mt's dot_product does)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        t, n = s.shape[-2], s.shape[-1]
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s.float().softmax(-1).to(q.dtype) @ v


def cmd_attention(a):
    dev = device_of(a)
    timing_defaults(a, dev)
    dt = DTYPES[a.dtype]
    causal = a.causal == "true"
    cases = []

    def add(kernel, b, t, h, d):
        c = (a.attention or kernel, b, t, h, a.kv_heads or h, d)
        if c not in cases:
            cases.append(c)

    if a.shapes:
        for b, t, h, d in parse_shapes(a.shapes, "BxTxHxD"):
            add("flash", b, t, h, d)
    elif dev.type == "cpu":
        add("flash", 1, 512, 8, 64)
        add("dot_product", 1, 512, 8, 64)
    else:
        add("flash", 1, 1024, 32, 128)
        add("dot_product", 1, 1024, 32, 128)
        add("flash", 1, 4096, 32, 128)
        add("flash", 2, 4096, 32, 128)
    peak = peak_tflops(a, dev)
    unit = math.sqrt(3.0)  # uniform with variance 1
    failed = 0
    for kernel, b, t, h, kv, d in cases:
        ctx, backend_name = sdpa_backend(kernel)
        fields = {"bench": "attention", "name": f"{kernel}.{b}x{t}x{h}x{d}", "attention": kernel,
                  "backend": dev.type, "B": b, "T": t, "S": t, "H": h, "kv_heads": kv, "D": d,
                  "causal": causal, "dtype": a.dtype, "torch_backend": backend_name}
        try:
            if h % kv:
                raise ValueError(f"kv_heads={kv} must divide the {h} query heads")
            if kernel == "flash" and backend_name == "explicit":
                raise RuntimeError(f"torch {torch.__version__} has no scaled_dot_product_attention")
            # Stored [B, T, H, D] as mt stores them; SDPA takes the [B, H, T, D] views.
            q = random((b, t, h, d), dt, dev, unit).requires_grad_()
            k = random((b, t, kv, d), dt, dev, unit).requires_grad_()
            v = random((b, t, kv, d), dt, dev, unit).requires_grad_()
            dout = random((b, t, h, d), dt, dev, unit)

            def forward():
                return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)

            def forward_only():
                with torch.no_grad():
                    forward()

            def forward_backward():
                forward().backward(dout.transpose(1, 2))

            with ctx:
                fwd_ms = median_ms(forward_only, dev, a)
                fwd_bwd_ms = median_ms(forward_backward, dev, a)
            flop = 4.0 * b * t * t * h * d * (0.5 if causal else 1.0)
            fields.update({"fwd_ms": round(fwd_ms, 4),
                           "fwd_tflops": round(flop / (fwd_ms * 1e-3) / 1e12, 4),
                           "fwd_bwd_ms": round(fwd_bwd_ms, 4),
                           "fwd_bwd_tflops": round(3 * flop / (fwd_bwd_ms * 1e-3) / 1e12, 4),
                           "peak_tflops": peak})
            emit(fields, a, dev)
            del q, k, v, dout
        except Exception as e:
            failed += 1
            fail(fields, e, a, dev)
    return 1 if failed else 0


# ---- train --------------------------------------------------------------------------------------

class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        if hasattr(F, "rms_norm"):  # torch >= 2.4: one fused op
            return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def rope_tables(seq, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def rotate(x, cos, sin):  # x [B, H, T, D], rotate_half pairing (Hugging Face Llama)
    h = x.shape[-1] // 2
    r = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos.to(x.dtype) + r * sin.to(x.dtype)


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["d_model"], c["head_dim"]
        self.c = c
        self.n1, self.n2 = RMSNorm(d, c["eps"]), RMSNorm(d, c["eps"])
        self.wq = torch.nn.Linear(d, c["heads"] * hd, bias=False)
        self.wk = torch.nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.wv = torch.nn.Linear(d, c["kv_heads"] * hd, bias=False)
        self.wo = torch.nn.Linear(c["heads"] * hd, d, bias=False)
        self.wg = torch.nn.Linear(d, c["ffn"], bias=False)
        self.wu = torch.nn.Linear(d, c["ffn"], bias=False)
        self.wd = torch.nn.Linear(c["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        c = self.c
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(b, t, c["heads"], c["head_dim"]).transpose(1, 2)
        k = self.wk(h).view(b, t, c["kv_heads"], c["head_dim"]).transpose(1, 2)
        v = self.wv(h).view(b, t, c["kv_heads"], c["head_dim"]).transpose(1, 2)
        o = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        return x + self.wd(F.silu(self.wg(h)) * self.wu(h))


class Model(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.emb = torch.nn.Embedding(c["vocab"], c["d_model"])
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["d_model"], c["eps"])
        self.head = torch.nn.Linear(c["d_model"], c["vocab"], bias=False)
        cos, sin = rope_tables(c["seq"], c["head_dim"], c["theta"])
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.head(self.norm(x))


def cmd_train(a):
    dev = device_of(a)
    cfg = read_config(a.model)
    c = {"vocab": cfg["vocab_size"], "d_model": cfg["base_emb_dim"],
         "heads": cfg["base_num_query_heads"], "kv_heads": cfg["base_num_kv_heads"],
         "head_dim": cfg["head_dim"], "ffn": cfg["base_mlp_dim"],
         "layers": a.layers or cfg["base_num_decoder_layers"],
         "seq": a.seq or cfg["max_target_length"], "batch": a.batch or cfg["per_device_batch_size"],
         "eps": float(cfg.get("normalization_layer_epsilon", 1e-5)),
         "theta": float(cfg.get("rope_max_timescale", 10000.0))}
    variant = "compile" if a.compile else "eager"
    fields = {"bench": "train", "name": a.name or a.model, "model": a.model, "variant": variant,
              "backend": dev.type, "batch": c["batch"], "seq": c["seq"], "layers": c["layers"],
              "steps": a.steps, "dtype": a.dtype, "weight_dtype": "float32"}
    try:
        torch.manual_seed(0)
        try:  # f32 master weights, made on the device (fast initialisation)
            with torch.device(dev):
                model = Model(c)
        except (AttributeError, TypeError):  # torch < 2.0: no device context
            model = Model(c).to(dev)
        run = torch.compile(model) if a.compile else model
        decay = [p for p in model.parameters() if p.ndim == 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        try:
            opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                    fused=dev.type == "cuda")
        except (TypeError, RuntimeError):  # no fused AdamW in this torch
            opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
        matmul_params = sum(p.numel() for n, p in model.named_parameters()
                            if p.ndim == 2 and not n.startswith("emb."))
        flops_per_token = (6 * matmul_params
                           + 6 * c["layers"] * c["heads"] * c["head_dim"] * c["seq"])
        bf16 = a.dtype == "bfloat16"
        times, loss = [], float("nan")
        for _ in range(a.steps):
            ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=dev)
            sync(dev)
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                logits = run(ids[:, :-1])
            l = F.cross_entropy(logits.reshape(-1, c["vocab"]).float(), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            l.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss = l.item()
            sync(dev)
            times.append(time.perf_counter() - t0)
            del logits, l
        skip = a.skip if a.skip is not None else (3 if a.compile else 2)
        dt = statistics.median(times[skip:] if len(times) > skip else times)
        tps = c["batch"] * c["seq"] / dt
        peak = peak_tflops(a, dev)
        fields.update({
            "tokens_per_sec": round(tps, 2),
            "model_tflops_per_sec": round(tps * flops_per_token / 1e12, 5),
            "mfu": round(tps * flops_per_token / (peak * 1e12), 5) if peak > 0 else None,
            "step_time_ms": round(dt * 1e3, 2), "final_loss": round(loss, 4),
            "flops_per_token": flops_per_token, "peak_tflops": peak,
            "first_step_ms": round(times[0] * 1e3, 1)})
        if dev.type == "cuda":
            fields["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(dev) / 1e6, 1)
        emit(fields, a, dev)
        return 0
    except Exception as e:
        fail(fields, e, a, dev)
        return 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    common.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    common.add_argument("--peak_tflops", type=float, help="for MFU (default: 989 on H100/H200)")
    timing = argparse.ArgumentParser(add_help=False)
    timing.add_argument("--warmup", type=int)
    timing.add_argument("--iters", type=int)
    timing.add_argument("--repeats", type=int)

    g = sub.add_parser("gemm", parents=[common, timing], help="torch.matmul at transformer shapes")
    g.add_argument("--shapes", help="MxKxN[,MxKxN...] (default: model projections)")
    g.add_argument("--model", help="one model's projections (configs/models/NAME.yml)")
    g.add_argument("--tokens", type=int, help="M of the model projections (default 8192; CPU 256)")
    g.add_argument("--trans_a", action="store_true")
    g.add_argument("--trans_b", action="store_true")

    t = sub.add_parser("attention", parents=[common, timing], help="SDPA forward and backward")
    t.add_argument("--shapes", help="BxTxHxD[,BxTxHxD...] (default: mt's cases)")
    t.add_argument("--attention", choices=["flash", "dot_product"], help="one kernel for all cases")
    t.add_argument("--kv_heads", type=int)
    t.add_argument("--causal", choices=["true", "false"], default="true")

    r = sub.add_parser("train", parents=[common], help="training throughput and MFU")
    r.add_argument("--model", default="llama-bench-1b", help="configs/models/NAME.yml or a path")
    r.add_argument("--name", help="the case name in the JSON line (default: the model)")
    r.add_argument("--layers", type=int)
    r.add_argument("--seq", type=int)
    r.add_argument("--batch", type=int)
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--skip", type=int, help="first steps left out of the median (2; compile 3)")
    r.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()
    return {"gemm": cmd_gemm, "attention": cmd_attention, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
