#!/usr/bin/env python3
"""Builds the corpus and tokenizer that ship in data/ for the embedded default run.

Source: Jane Austen's six completed novels (Project Gutenberg texts, public domain) as carried
by Debian's `r-cran-janeaustenr` package. The package stores them as R objects in a lazy-load
database; this script reads that format itself so R is not needed.

Steps:
  1. fetch the .deb with `apt-get download` (or take --deb), unpack it with `dpkg-deb -x`;
  2. decode data/Rdata.{rdx,rdb} (R serialization, XDR) into one character vector per novel;
  3. strip any Project Gutenberg header/footer, re-flow hard-wrapped lines into paragraphs,
     split each novel into chapters (one document per chapter);
  4. hold out every 20th chapter (~5%) as the eval split;
  5. train a byte-level BPE tokenizer (Hugging Face `tokenizers`, vocab 8192, specials <s> </s>)
     on the train split and save data/tokenizer.json;
  6. write data/corpus.{train,eval}.tokens in mt's `tokens` format (see data/README.md) and
     data/corpus.{train,eval}.jsonl (the same documents as text: one {"text": ...} per line);
  7. print the unigram entropy of the eval split.

Usage: python3 tools/prepare_corpus.py [--deb r-cran-janeaustenr_1.0.0-1_all.deb] [--out data]
Requires: pip install tokenizers. Nothing in data/ needs Python at build or test time.
"""

import argparse
import collections
import glob
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib

VOCAB_SIZE = 8192
BOS, EOS = "<s>", "</s>"
EVAL_EVERY = 20  # every 20th chapter is held out: ~5%

# mt `tokens` file: 32-byte little-endian header, then `count` ids of `dtype` bytes each.
TOKENS_MAGIC = b"MTTOKENS"
TOKENS_VERSION = 1
NO_ID = 0xFFFFFFFF

BOOKS = [  # R object name -> title, in publication order
    ("sensesensibility", "Sense and Sensibility"),
    ("prideprejudice", "Pride and Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]


# ---------------------------------------------------------------------------------------------
# R serialization (the subset used by character-vector data sets and lazy-load indices)


class RReader:
    """Decodes R's XDR serialization format (versions 2 and 3)."""

    NILVALUE, SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC = 254, 1, 2, 9, 10, 13, 14, 16, 19
    REF, GLOBALENV, EMPTYENV, BASEENV, MISSINGARG, BASENAMESPACE = 255, 253, 242, 241, 251, 247

    def __init__(self, data):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization stream")
        self.d, self.p, self.refs = data, 2, []
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # minimal R version to read it
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name

    def int(self):
        v = struct.unpack_from(">i", self.d, self.p)[0]
        self.p += 4
        return v

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if t in (self.NILVALUE, self.GLOBALENV, self.EMPTYENV, self.BASEENV, self.MISSINGARG,
                 self.BASENAMESPACE):
            return None
        if t == self.REF:
            i = flags >> 8
            return self.refs[(i if i else self.int()) - 1]
        if t == self.SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if t == self.CHAR:
            n = self.int()
            if n == -1:
                return None
            s = self.d[self.p:self.p + n].decode("utf-8", errors="replace")
            self.p += n
            return s
        if t == self.LIST:  # pairlist -> dict of tag -> value (attributes, lazy-load index)
            out = {}
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                out[tag if tag is not None else len(out)] = self.item()
                flags = self.int()
                t = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
                if t != self.LIST:
                    if t != self.NILVALUE:
                        raise ValueError("unsupported pairlist tail type %d" % t)
                    return out
        if t in (self.STR, self.VEC, self.INT, self.LGL, self.REAL):
            n = self.int()
            if t == self.STR or t == self.VEC:
                v = [self.item() for _ in range(n)]
            elif t == self.REAL:
                v = list(struct.unpack_from(">%dd" % n, self.d, self.p))
                self.p += 8 * n
            else:
                v = list(struct.unpack_from(">%di" % n, self.d, self.p))
                self.p += 4 * n
            if has_attr:
                attrs = self.item()
                names = attrs.get("names")
                if names is not None and t == self.VEC:
                    return dict(zip(names, v))
            return v
        raise ValueError("unsupported R type %d at offset %d" % (t, self.p))


def read_lazyload_db(rdx_path):
    """Returns {name: value} of an R lazy-load database (<base>.rdx + <base>.rdb)."""
    with open(rdx_path, "rb") as f:
        index = RReader(zlib.decompress(f.read(), 15 + 32)).item()
    with open(rdx_path[:-4] + ".rdb", "rb") as f:
        rdb = f.read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset:offset + length]
        # 4-byte big-endian uncompressed length, then a zlib stream (R's default compression).
        out[name] = RReader(zlib.decompress(blob[4:])).item()
    return out


# ---------------------------------------------------------------------------------------------
# Text cleaning


def strip_gutenberg(lines):
    """Drops a Project Gutenberg header and footer when present (the R package ships them
    already stripped; this keeps the script right for raw Gutenberg files too)."""
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        if re.match(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG", line or ""):
            start = i + 1
        elif re.match(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", line or ""):
            end = i
            break
    return lines[start:end]


CHAPTER_RE = re.compile(r"^\s*(CHAPTER|Chapter)\s+([IVXLC]+|\d+)\b")


def reflow(lines):
    """Joins hard-wrapped lines into paragraphs separated by blank lines."""
    paras, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


def chapters(lines):
    """Splits a novel into chapter documents; front matter stays with the first chapter."""
    docs, cur, seen = [], [], False
    for line in lines:
        if CHAPTER_RE.match(line or ""):
            if seen:
                docs.append(cur)
                cur = []
            seen = True
        cur.append(line)
    docs.append(cur)
    return [t for t in (reflow(d) for d in docs) if t]


# ---------------------------------------------------------------------------------------------
# Outputs


def write_tokens(path, docs_ids, bos_id, eos_id, vocab):
    dtype = 2 if vocab <= 65536 else 4
    flat = []
    for ids in docs_ids:
        flat.append(bos_id)
        flat.extend(ids)
        flat.append(eos_id)
    with open(path, "wb") as f:
        f.write(TOKENS_MAGIC)
        f.write(struct.pack("<IIQII", TOKENS_VERSION, dtype, len(flat), eos_id, bos_id))
        f.write(struct.pack("<%d%s" % (len(flat), "H" if dtype == 2 else "I"), *flat))
    return flat


def entropy(counts):
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def fetch_deb(workdir):
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=workdir, check=True)
    debs = glob.glob(os.path.join(workdir, "r-cran-janeaustenr_*.deb"))
    if not debs:
        sys.exit("apt-get download produced no r-cran-janeaustenr .deb")
    return debs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deb", help="r-cran-janeaustenr .deb (default: apt-get download it)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data"))
    args = ap.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb or fetch_deb(tmp)
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        rdx = glob.glob(os.path.join(tmp, "x", "usr", "lib", "R", "site-library", "janeaustenr",
                                     "data", "Rdata.rdx"))
        if not rdx:
            sys.exit("%s holds no data/Rdata.rdx" % deb)
        objects = read_lazyload_db(rdx[0])

    train_docs, eval_docs, n = [], [], 0
    for name, title in BOOKS:
        lines = strip_gutenberg(objects[name])
        for doc in chapters(lines):
            (eval_docs if n % EVAL_EVERY == EVAL_EVERY - 1 else train_docs).append(doc)
            n += 1
    print("documents: %d train, %d eval (%d chapters of %d novels)"
          % (len(train_docs), len(eval_docs), n, len(BOOKS)))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train_docs, trainer=trainer)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    print("tokenizer: vocab %d, <s>=%d, </s>=%d" % (vocab, bos_id, eos_id))

    stats = {}
    for split, docs in (("train", train_docs), ("eval", eval_docs)):
        ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
        for d, i in zip(docs, ids):
            if tok.decode(i, skip_special_tokens=False) != d:
                sys.exit("tokenizer does not round-trip a %s document" % split)
        flat = write_tokens(os.path.join(args.out, "corpus.%s.tokens" % split), ids, bos_id,
                            eos_id, vocab)
        with open(os.path.join(args.out, "corpus.%s.jsonl" % split), "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        text_bytes = sum(len(d.encode("utf-8")) for d in docs)
        stats[split] = collections.Counter(flat)
        print("%s: %d documents, %d bytes of text, %d tokens (%.2f bytes/token)"
              % (split, len(docs), text_bytes, len(flat), text_bytes / len(flat)))

    # Entropy of the eval split's own unigram distribution (the best a unigram model could do
    # in-sample), and the cross-entropy of eval under the train unigram distribution (add-one
    # smoothed): the loss a model that learned only token frequencies reaches on eval.
    h = entropy(stats["eval"])
    tr, ev = stats["train"], stats["eval"]
    tr_n = sum(tr.values()) + vocab
    xh = -sum(c * math.log((tr.get(t, 0) + 1) / tr_n) for t, c in ev.items()) / sum(ev.values())
    print("eval unigram entropy: %.4f nats/token (%.4f bits/token)" % (h, h / math.log(2)))
    print("eval cross-entropy under train unigram: %.4f nats/token (%.4f bits/token)"
          % (xh, xh / math.log(2)))


if __name__ == "__main__":
    main()
