#!/usr/bin/env python3
"""The table of bench/gpu/run.sh: mt against PyTorch, case by case, from its raw.jsonl.

  table.py RAW_JSONL STATUS_TXT   -> markdown on stdout

raw.jsonl holds the JSON lines of `mt bench gemm|attention|train` and of
bench/peers/torch_gpu.py, each tagged by run.sh with "source" (mt or torch) and "case". GEMM and
attention rows join the two sides by shape; training rows by case name. status.txt holds one
tab-separated line per step (build, ctest, each benchmark command): step, result, detail.
"""
import json
import sys

GEMM_TARGET = 0.95  # mt / torch.matmul TFLOP/s
MFU_TARGET = 0.45  # mt's model FLOPs utilisation
EAGER_TARGET = 1.3  # mt / PyTorch eager tokens/s


def load(path):
    recs = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        recs.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return recs


def fmt(x, digits=None, pct=False):
    """A figure with `digits` decimals (default: 1 from 10 up, else 3), 'n/a' for None."""
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if pct:
        return f"{100 * x:.{1 if digits is None else digits}f}%"
    if digits is None:
        digits = 1 if abs(x) >= 10 else 3
    return f"{x:.{digits}f}"


def short(msg, n=70):
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= n else msg[: n - 1] + "…"


def value(rec, field):
    """A record's figure, 'error' when the case failed, None when there is no record."""
    if rec is None:
        return None
    if "error" in rec:
        return "error"
    return rec.get(field)


def ratio(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return a / b
    return None


def verdict(x, target):
    if target is None:
        return ""
    if x is None:
        return "n/a"
    return "ok" if x >= target else "BELOW"


def main():
    recs = load(sys.argv[1])
    steps = []
    if len(sys.argv) > 2:
        try:
            with open(sys.argv[2]) as f:
                steps = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        except OSError:
            pass

    rows = []  # benchmark, case, mt, torch, ratio, target, verdict, note

    def pair(bench, key):
        """mt and torch records of one bench, joined on key(rec), in order of first appearance."""
        keys, mt, pt = [], {}, {}
        for r in recs:
            if r.get("bench") != bench:
                continue
            if r.get("source") not in ("mt", "torch"):
                continue  # a variant of mt's (below)
            k = key(r)
            if k not in keys:
                keys.append(k)
            (mt if r.get("source") == "mt" else pt).setdefault(k, r)
        return [(k, mt.get(k), pt.get(k)) for k in keys]

    gemm_key = lambda r: (r.get("M"), r.get("K"), r.get("N"), r.get("trans_a"), r.get("trans_b"),
                          r.get("dtype"))
    for k, m, p in pair("gemm", gemm_key):
        name = (m or p).get("name", "x".join(str(d) for d in k[:3]))
        mv, pv = value(m, "tflops"), value(p, "tflops")
        r = ratio(mv, pv)
        err = (m or {}).get("error") or (p or {}).get("error")
        note = short(err or f"M={k[0]} K={k[1]} N={k[2]}")
        rows.append(("GEMM TFLOP/s", name, fmt(mv), fmt(pv), fmt(r, 2), f">= {GEMM_TARGET}",
                     verdict(r, GEMM_TARGET), note))

    att_key = lambda r: (r.get("attention"), r.get("B"), r.get("T"), r.get("H"), r.get("kv_heads"),
                         r.get("D"), r.get("causal"), r.get("dtype"))
    for k, m, p in pair("attention", att_key):
        name = f"{k[0]} B={k[1]} T={k[2]} H={k[3]} D={k[5]}" + (" causal" if k[6] else "")
        err = (m or {}).get("error") or (p or {}).get("error")
        torch_kernel = (p or {}).get("torch_backend", "")
        for label, field in (("fwd", "fwd_tflops"), ("fwd+bwd", "fwd_bwd_tflops")):
            mv, pv = value(m, field), value(p, field)
            r = ratio(mv, pv)
            note = short(err) if err else (f"torch SDPA {torch_kernel}" if torch_kernel else "")
            rows.append((f"attention {label} TFLOP/s", name, fmt(mv), fmt(pv), fmt(r, 2), "-", "",
                         note))

    # A/B: mt's flash with its dk/dv kernel forced to whole query tiles (source mt-dkv1), against
    # the default run above (two slices at head_dim 128).
    default_att = {att_key(r): r for r in recs
                   if r.get("bench") == "attention" and r.get("source") == "mt"}
    for r in recs:
        if r.get("bench") != "attention" or r.get("source") != "mt-dkv1":
            continue
        k = att_key(r)
        d = default_att.get(k)
        name = f"{k[0]} B={k[1]} T={k[2]} H={k[3]} D={k[5]}" + (" causal" if k[6] else "")
        vv, dv = value(r, "fwd_bwd_tflops"), value(d, "fwd_bwd_tflops")
        note = short(r.get("error", "")) or f"default (sliced at D=128): {fmt(dv)} TFLOP/s"
        rows.append(("A/B fwd+bwd TFLOP/s, MT_CUDA_FLASH_DKV_PARTS=1", name, fmt(vv), "",
                     fmt(ratio(vv, dv), 2), "-", "", note))

    train_mt, train_eager, train_compile, cases = {}, {}, {}, []
    for r in recs:
        if r.get("bench") != "train":
            continue
        if r.get("source") == "mt":
            c = r.get("case")
            train_mt[c] = r  # a retry (dot_product) replaces a failed first try
        else:
            c = r.get("name") or r.get("case")
            (train_compile if r.get("variant") == "compile" else train_eager)[c] = r
        if c not in cases:
            cases.append(c)
    for c in cases:
        m, e, cp = train_mt.get(c), train_eager.get(c), train_compile.get(c)
        shape = m or e or cp or {}
        desc = f"B={shape.get('batch')} T={shape.get('seq')}"
        if m and "attention" in m:
            desc += f", mt attention={m['attention']}"
        err = short((m or {}).get("error") or (e or {}).get("error") or "")
        mt_tps, eager_tps = value(m, "tokens_per_sec"), value(e, "tokens_per_sec")
        r = ratio(mt_tps, eager_tps)
        rows.append(("train tokens/s vs eager", c, fmt(mt_tps, 0), fmt(eager_tps, 0), fmt(r, 2),
                     f">= {EAGER_TARGET}", verdict(r, EAGER_TARGET), err or desc))
        mt_mfu, eager_mfu = value(m, "mfu"), value(e, "mfu")
        rows.append(("train MFU (mt vs eager)", c, fmt(mt_mfu, 1, pct=True),
                     fmt(eager_mfu, 1, pct=True), fmt(ratio(mt_mfu, eager_mfu), 2),
                     f"mt >= {MFU_TARGET:.0%}", verdict(mt_mfu, MFU_TARGET), desc))
        if cp is not None:
            comp_tps = value(cp, "tokens_per_sec")
            first = fmt(cp.get("first_step_ms"), 0)
            note = short(cp.get("error", "")) or f"step 1 (compiling): {first} ms"
            rows.append(("train tokens/s vs torch.compile", c, fmt(mt_tps, 0), fmt(comp_tps, 0),
                         fmt(ratio(mt_tps, comp_tps), 2), "-", "", note))

    # Decode: mt alone (no peer in the script); weight bytes read per second at batch 1 say how
    # close it is to the memory bound.
    for r in recs:
        if r.get("bench") != "decode" or r.get("source") != "mt":
            continue
        for d in r.get("results", []):
            bw = d.get("decode_batch1_bytes_per_sec")
            note = (f"batch 1 reads {fmt(bw / 1e9 if bw else None, 0)} GB/s of weights; "
                    f"batch 8 {fmt(d.get('decode_batch8_tokens_per_sec'), 1)} tok/s; "
                    f"prefill 512: {fmt(d.get('prefill_512_tokens_per_sec'), 0)} tok/s")
            quant = " int8 weights" if d.get("quantization") == "int8" else ""
            if d.get("kv_cache", "").startswith("int8"):
                quant += ", int8 cache"
            rows.append(("decode batch 1 tokens/s", f"{d.get('model')} {d.get('dtype')}{quant}",
                         fmt(d.get("decode_batch1_tokens_per_sec"), 1), "", "", "-", "", note))

    out = ["## mt vs PyTorch on the GPU (bench/gpu/run.sh)", ""]
    if steps:
        out += ["| step | result | detail |", "| --- | --- | --- |"]
        for s in steps:
            s = (s + ["", "", ""])[:3]
            out.append(f"| {s[0]} | {s[1]} | {short(s[2], 110)} |")
        out.append("")
    out += ["| benchmark | case | mt | torch | mt/torch | target | verdict | note |",
            "| --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    if not rows:
        out.append("| (no results) | | | | | | | |")
    met = sum(1 for r in rows if r[6] == "ok")
    judged = sum(1 for r in rows if r[6] in ("ok", "BELOW", "n/a"))
    out += ["", f"targets met: {met} of {judged}"]
    print("\n".join(out))


if __name__ == "__main__":
    main()
