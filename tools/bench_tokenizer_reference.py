#!/usr/bin/env python3
"""Single-thread encode throughput of the reference tokenizer libraries on the shipped corpus,
to compare with bench/kernels/tokenizer_bench.cpp (same input, same tokenizers).

Needs `pip install tokenizers sentencepiece`. Reports MB/s of input text per CPU second (the
C++ bench's bytes_per_second is per CPU second too), best of a few passes.
  python3 tools/bench_tokenizer_reference.py
"""
import json
import os
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before importing tokenizers
import sentencepiece as spm  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(name, encode, docs, passes):
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    best, ids = float("inf"), 0
    for _ in range(passes):
        t0 = time.process_time()
        ids = sum(len(encode(d)) for d in docs)
        best = min(best, time.process_time() - t0)
    print(f"{name}: {nbytes / best / 1e6:.1f} MB/s ({ids} ids, {nbytes} bytes)")


def main():
    with open(os.path.join(ROOT, "data", "corpus.train.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    tok = Tokenizer.from_file(os.path.join(ROOT, "data", "tokenizer.json"))
    bench("tokenizers BPE (data/tokenizer.json)",
          lambda d: tok.encode(d, add_special_tokens=False).ids, docs, 3)
    sp = spm.SentencePieceProcessor(
        model_file=os.path.join(ROOT, "tests", "golden", "tokenizer", "sp.model"))
    bench("sentencepiece BPE (tests/golden/tokenizer/sp.model)", sp.encode, docs, 2)


if __name__ == "__main__":
    main()
