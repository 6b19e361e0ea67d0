#!/usr/bin/env python3
"""Hugging Face transformers' Llama decode on a GPU: the peer of `mt bench decode backend=cuda`.

    python3 bench/peers/hf_decode_gpu.py [--model llama-bench-1b] [--dtype bfloat16]
        [--steps 64] [--static]

Random weights of the mt model config (configs/models/NAME.yml), the same shapes as mt's
benchmark: prefill of a 512-token prompt (one forward; the logits of the last position only, as
generate computes them, and of every position), then greedy decode of `steps` tokens after a
128-token prompt at batch 1 and 8 (model.generate, eager; --static: a static cache, the
configuration transformers documents for speed without torch.compile). Prints one JSON line.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_gpu import read_config  # noqa: E402

import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-bench-1b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--static", action="store_true")
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    c = read_config(a.model)
    dt = getattr(torch, a.dtype)
    cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["base_emb_dim"],
                      intermediate_size=c["base_mlp_dim"],
                      num_hidden_layers=c["base_num_decoder_layers"],
                      num_attention_heads=c["base_num_query_heads"],
                      num_key_value_heads=c["base_num_kv_heads"], head_dim=c["head_dim"],
                      max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dt).eval()
    dev = torch.device("cuda")
    V = c["vocab_size"]

    def timed(fn, reps=3):
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    res = {"peer": "transformers", "model": a.model, "dtype": a.dtype,
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    ids = torch.randint(0, V, (1, 512), device=dev)
    with torch.no_grad():
        t = timed(lambda: model(ids, logits_to_keep=1))
        res["prefill_512_last_logits_tokens_per_sec"] = round(512 / t, 1)
        t = timed(lambda: model(ids))
        res["prefill_512_all_logits_tokens_per_sec"] = round(512 / t, 1)
        for batch in (1, 8):
            prompt = torch.randint(0, V, (batch, 128), device=dev)
            kw = dict(max_new_tokens=a.steps, min_new_tokens=a.steps, do_sample=False,
                      pad_token_id=0)
            if a.static:
                kw["cache_implementation"] = "static"
            # generate's time includes its prefill of 128 tokens; subtract one forward's.
            tg = timed(lambda: model.generate(prompt, **kw), reps=2)
            tp = timed(lambda: model(prompt, logits_to_keep=1))
            res[f"decode_batch{batch}_tokens_per_sec"] = round(batch * a.steps / (tg - tp), 1)
    res["cache"] = "static" if a.static else "dynamic"
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
