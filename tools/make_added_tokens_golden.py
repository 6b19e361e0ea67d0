#!/usr/bin/env python3
"""Reference token ids for added tokens with every flag (tests/unit/tokenizer_test.cpp).

Makes tests/golden/tokenizer/:
  added_tokens.json        llama3.json (made by make_tokenizer_golden.py) behind an NFKC
                           normalizer, with added tokens that have lstrip / rstrip, normalized
                           true and false, single_word, and combinations of them
  added_tokens_cases.json  the ids and decoding the reference library gives for texts that tell
                           each flag's handling apart (in cases.json's format)

What the texts check, as the reference library matches added tokens:
  - lstrip/rstrip swallow any Unicode whitespace (U+3000, U+00A0, U+2009, ...), not only ASCII's;
  - tokens with normalized=false are found in the raw text, the others in the normalized text
    between them ("\ufb01!" is "fi!" after NFKC; "\u2460" is matched as written, not as "1");
  - a single_word token is not matched where a word character (Unicode \\w: letters, marks,
    digits, '_', the joiners, the circled letters) touches it, and the scan goes on after it.

Needs `pip install tokenizers` (any Python 3.9+). Run from anywhere, after
make_tokenizer_golden.py (it reads its llama3.json):
  python3 tools/make_added_tokens_golden.py
The outputs are committed; tests do not need Python.
"""
import json
import os
import sys

import tokenizers
from tokenizers import AddedToken, Tokenizer, normalizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizer")

TEXTS = [
    "",
    "plain text without added tokens",
    # lstrip + rstrip (special, so normalized=false: raw whitespace)
    "a<m>b",
    "a <m> b",
    "a\u3000<m>b",
    "a<m>\u2009b",
    "x\t\u00a0<m>",
    "a \u3000\u00a0\u2002<m>\u205f\u202f\u1680\u0085\u2028 b",
    "<m> <m>\u3000<m>",
    "\u3000<m>\u3000",
    "a\u200b<m>b",  # U+200B ZERO WIDTH SPACE is not White_Space
    # lstrip alone, rstrip alone
    "x\u3000<ls>\u3000y",
    "x\u3000<rs>\u3000y",
    "x <ls> y <rs> z",
    "<rs>\u3000<ls>",
    "<rs> \u00a0 <ls>",
    # normalized=true tokens are found after NFKC; normalized=false ones before it
    "\ufb01!",
    "fi!",
    "f i!",
    "so \ufb01! and fi! and \ufb01 !",
    "\u216b",
    "XII",
    "Chapter \u216b, chapter XII",
    "\u2460",
    "1",
    "\u2460 1 \u2460",
    "\u1112\u1161\u11ab\u1100\u116e\u11a8",  # Hangul jamo: NFKC composes them
    "\ud55c\uad6d",
    "a<n>b",
    "x\u3000<n>\u3000y",
    "x\u00a0<n>",
    "\uff1cn\uff1e",  # fullwidth < n >: NFKC gives <n>
    "<ls>\ufb01!<rs>XII",
    "<m>\u216b<m>",
    # single_word
    "swordfish",
    "aword",
    "worda",
    "a word b",
    "word",
    "word word",
    "wordword",
    "wordx",  # "word" is dropped, and "dx" is not tried inside it
    "word_",
    "_word",
    "word1",
    "word\u00e9",
    "word\u0301",
    "\u24b6word",
    "word\u200d",
    "\u4e2dword",
    "word.",
    "(word)",
    "word<m>word",
    "<m>word<m>",
    "\u216bword",
    "\u3000word\u3000",
    "zq",
    "a zq b",
    "zqa",
    "<ls>zq",
    "\uff5a\uff51",  # fullwidth zq: normalized, then matched as a single word
    "a\uff5a\uff51",
    "dx and word and \ufb01! and \u2460 and <m> and <n> and XII",
]


def build(base, path):
    tok = Tokenizer.from_file(base)
    tok.normalizer = normalizers.NFKC()
    # Added after the normalizer is set, so the library records each normalized form.
    tok.add_special_tokens([AddedToken("<m>", lstrip=True, rstrip=True)])
    tok.add_tokens([
        AddedToken("<ls>", lstrip=True, normalized=False),
        AddedToken("<rs>", rstrip=True, normalized=False),
        AddedToken("fi!", normalized=True),
        AddedToken("\u216b", normalized=True),  # ROMAN NUMERAL TWELVE: "XII" after NFKC
        AddedToken("\u2460", normalized=False),  # CIRCLED DIGIT ONE: "1" after NFKC
        AddedToken("\ud55c\uad6d", normalized=True),
        AddedToken("<n>", lstrip=True, rstrip=True, normalized=True),
        AddedToken("word", single_word=True, normalized=False),
        AddedToken("dx", normalized=False),
        AddedToken("zq", single_word=True, normalized=True),
    ])
    with open(path, "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))


def main():
    path = os.path.join(OUT, "added_tokens.json")
    build(os.path.join(OUT, "llama3.json"), path)
    tok = Tokenizer.from_file(path)
    cases = []
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False).ids
        cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    result = {"generator": "tools/make_added_tokens_golden.py",
              "versions": {"tokenizers": tokenizers.__version__},
              "tokenizers": [{
                  "name": "added_tokens", "path": "tests/golden/tokenizer/added_tokens.json",
                  "type": "huggingface", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                  "bos_id": tok.token_to_id("<|begin_of_text|>"),
                  "eos_id": tok.token_to_id("<|end_of_text|>"), "cases": cases}]}
    with open(os.path.join(OUT, "added_tokens_cases.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"added_tokens: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
