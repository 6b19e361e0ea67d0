#!/usr/bin/env python3
"""A Gemma-style SentencePiece tokenizer of 256000 pieces, and transformers' ids for it.

Gemma's tokenizer.model (256000 pieces) is Google's and is not copied here. What makes it
Gemma's is reproduced instead, at Gemma's size:
  - SentencePiece BPE with byte fallback (<0x00>..<0xFF>), digits split, no normalization, no
    dummy prefix, whitespace kept and whitespace-only pieces allowed;
  - Gemma's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3; user-defined <start_of_turn>,
    <end_of_turn>, <mask> and runs of newlines and spaces, as Gemma's vocabulary has;
  - 256000 pieces: trained to 4000 on the shipped corpus, then <unusedN> pieces up to 256000
    (ordinary pieces no merge reaches, so the vocabulary, the id range and the model's size are
    Gemma's; as control pieces transformers would add each as a special token, which takes
    its converter quadratic time), appended as ModelProto `pieces` entries (protobuf concatenates
    repeated fields, so the appended bytes extend the list; the C++ test appends the same
    bytes, and the file's FNV-1a hash is recorded to check that both built the same model).

Writes tests/golden/tokenizer/:
  gemma_sp.model   the trained 4000-piece model (the padding is made from the recipe below)
  gemma.json       the recipe (pad_to, the unused pieces' form), the padded model's size and
                   hash (mt's FNV-1a), and for the tricky strings of make_tokenizer_golden.py and
                   random mixed-script ones: transformers' GemmaTokenizer ids (no specials),
                   SentencePiece's own ids (checked equal), and the decoding

Run with the pinned environment (tools/setup_reference_env_tf5.sh, plus `pip install
sentencepiece protobuf`):
  .venv-tf5/bin/python tools/make_gemma_tokenizer_golden.py
"""
import json
import os
import random
import struct
import sys
import tempfile

import sentencepiece as spm
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tokenizer_golden import (TRICKY, corpus_texts, random_strings,  # noqa: E402
                                   train_sentencepiece)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizer")
PAD_TO = 256000
NORMAL = 1  # SentencePiece's ModelProto.SentencePiece.Type


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def unused_pieces(first, count):
    """ModelProto field 1 entries <unused0>.. : piece (1, string), score (2, float 0), type (3)."""
    out = bytearray()
    for i in range(count):
        name = f"<unused{i}>".encode()
        body = b"\x0a" + varint(len(name)) + name + b"\x15" + struct.pack("<f", 0.0) + \
            b"\x18" + varint(NORMAL)
        out += b"\x0a" + varint(len(body)) + body
    return bytes(out)


def fnv1a64(data):
    """mt's FNV-1a (core/src/fnv1a.h), whose offset basis is 1469598103934665603."""
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def main():
    texts = corpus_texts(os.path.join(ROOT, "data", "corpus.train.jsonl"))
    train_sentencepiece(
        texts, OUT, prefix="gemma_sp", vocab_size=4000, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, character_coverage=0.9995,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "<mask>", "\n", "\n\n",
                              "\u2581\u2581", "\u2581\u2581\u2581\u2581"])
    with open(os.path.join(OUT, "gemma_sp.model"), "rb") as f:
        base = f.read()
    trained = spm.SentencePieceProcessor(model_file=os.path.join(OUT, "gemma_sp.model"))
    n = trained.get_piece_size()
    padded = base + unused_pieces(n, PAD_TO - n)
    strings = list(TRICKY) + ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
                              "\n\n\nthree newlines and    four spaces", "<unused7> stays text"]
    strings += random_strings(random.Random(1813), 40)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tokenizer.model")
        with open(path, "wb") as f:
            f.write(padded)
        sp = spm.SentencePieceProcessor(model_file=path)
        assert sp.get_piece_size() == PAD_TO, sp.get_piece_size()
        hf = transformers.GemmaTokenizer.from_pretrained(d)  # converts tokenizer.model
        assert len(hf) == PAD_TO, len(hf)
        cases = []
        for s in strings:
            ids = hf.encode(s, add_special_tokens=False)
            assert ids == sp.encode(s), (s, ids, sp.encode(s))
            cases.append({"text": s, "ids": ids, "decoded": sp.decode(ids)})
    golden = {
        "what": "a Gemma-style SentencePiece BPE (see tools/make_gemma_tokenizer_golden.py)",
        "trained_pieces": n, "pad_to": PAD_TO,
        "padding": "ModelProto pieces <unusedK> for K = 0.., score 0, type NORMAL (1), "
                   "appended to gemma_sp.model's bytes",
        "padded_bytes": len(padded), "padded_fnv1a64": f"{fnv1a64(padded):016x}",
        "bos_id": 2, "eos_id": 1, "pad_id": 0, "unk_id": 3,
        "versions": {"sentencepiece": spm.__version__, "transformers": transformers.__version__},
        "cases": cases,
    }
    with open(os.path.join(OUT, "gemma.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"gemma_sp.model: {n} trained pieces, padded to {PAD_TO} ({len(padded)} bytes), "
          f"{len(cases)} cases")


if __name__ == "__main__":
    main()
