#!/usr/bin/env python3
"""Writes the two files llm.c's CPU trainer reads, without the downloads its own scripts make:

  <out>/gpt2_124M.bin   a randomly initialised GPT-2 124M in llm.c's checkpoint format
                        (train_gpt2.c, gpt2_build_from_checkpoint): 256 int32 header [20240326,
                        3, maxT=1024, V=50257, L=12, NH=12, C=768, Vp=50304, 0...], then the 16
                        float32 tensors in fill_in_parameter_sizes' order (wte [Vp, C], wpe
                        [maxT, C], ln1w, ln1b, qkvw [L, 3C, C], qkvb, attprojw, attprojb, ln2w,
                        ln2b, fcw [L, 4C, C], fcb, fcprojw [L, C, 4C], fcprojb, lnfw, lnfb):
                        matrices N(0, 0.02) (GPT-2's init), LayerNorm gains 1, biases 0, the
                        padded vocabulary rows 0. Throughput does not depend on the values.
  <out>/train.bin       mt's shipped corpus (data/corpus.train.tokens, mt's `tokens` format) in
                        llm.c's data format (llmc/dataloader.h): 256 int32 header [20240520, 1,
                        num_tokens, 0...], then the ids as uint16.

Needs numpy. Usage: python3 bench/peers/llmc_inputs.py --out DIR [--tokens FILE]
"""
import argparse
import os
import struct

import numpy as np


def write_model(path, maxT=1024, V=50257, L=12, NH=12, C=768, Vp=50304, seed=0):
    rng = np.random.default_rng(seed)
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, 3, maxT, V, L, NH, C, Vp]

    def normal(n):
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))

    wte = normal(Vp * C)
    wte[V * C:] = 0  # padded rows
    tensors = [
        wte, normal(maxT * C),                              # wte, wpe
        np.ones(L * C, np.float32), np.zeros(L * C, np.float32),   # ln1w, ln1b
        normal(L * 3 * C * C), np.zeros(L * 3 * C, np.float32),    # qkvw, qkvb
        normal(L * C * C), np.zeros(L * C, np.float32),            # attprojw, attprojb
        np.ones(L * C, np.float32), np.zeros(L * C, np.float32),   # ln2w, ln2b
        normal(L * 4 * C * C), np.zeros(L * 4 * C, np.float32),    # fcw, fcb
        normal(L * C * 4 * C), np.zeros(L * C, np.float32),        # fcprojw, fcprojb
        np.ones(C, np.float32), np.zeros(C, np.float32),           # lnfw, lnfb
    ]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(t.astype(np.float32).tobytes())


def write_tokens(src, path):
    with open(src, "rb") as f:
        head = f.read(32)
        magic, version, width, count = head[:8], *struct.unpack("<IIQ", head[8:24])
        assert magic == b"MTTOKENS" and version == 1 and width in (2, 4), (magic, version, width)
        ids = np.frombuffer(f.read(count * width), dtype=np.uint16 if width == 2 else np.uint32)
    assert ids.size == count and int(ids.max()) < 65536
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.astype(np.uint16).tobytes())


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=os.path.join(here, "..", "..", "data", "corpus.train.tokens"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = os.path.join(a.out, "gpt2_124M.bin")
    if not os.path.exists(model):
        write_model(model + ".tmp")
        os.replace(model + ".tmp", model)
    write_tokens(a.tokens, os.path.join(a.out, "train.bin"))


if __name__ == "__main__":
    main()
