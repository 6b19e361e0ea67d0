#!/usr/bin/env python3
"""Reference token ids for the C++ tokenizers (tests/unit/tokenizer_test.cpp).

Makes tests/golden/tokenizer/:
  sp.model     SentencePiece BPE (vocab 1000, byte_fallback, Llama 2 options) trained with
               spm_train on data/corpus.train.jsonl
  llama3.json  a tiny Hugging Face byte-level BPE with Llama 3's pre-tokenizer: Split(<Llama 3
               regex>, isolated) then ByteLevel(use_regex=False); ignore_merges as Llama 3 sets
               it; merges written in the older "a b" string form
  bf.json      a tiny BPE without ByteLevel and with byte_fallback (<0xXX> tokens) and a
               ByteFallback+Fuse decoder, so unknown characters go through byte fallback
  splits.json  bf.json's model behind a Sequence of Split pre-tokenizers with every behavior
               (removed, merged with previous / next, contiguous, inverted) and Digits, and an
               added token with lstrip/rstrip
  qwen.json    Qwen 2 style: NFC normalizer, Qwen's regex (single digits), ByteLevel, no BOS
  llama2.json  Llama 2 converted to tokenizer.json style: normalizer Prepend("▁") +
               Replace(" ", "▁"), no pre-tokenizer, byte_fallback, unk token, decoder
               Replace + ByteFallback + Fuse + Strip
  tiktoken.model        llama3.json's byte-level vocabulary in tiktoken's format ("<base64>
                        <rank>" lines), read as MaxText's tokenizer_type=tiktoken does (Llama
                        3's regex and 256 special tokens after the ranks)
  metaspace.json        Metaspace pre-tokenizer and decoder (prepend_scheme always, split)
  metaspace_first.json  the same model as Mistral / Llama 2 (legacy=false) files have it:
                        Metaspace(prepend_scheme first, no split), ByteFallback + Metaspace
                        decoder
  cases.json   for every tokenizer (those above and the shipped data/tokenizer.json), the ids the
               reference library gives for a list of tricky strings, and its decoding of them

Needs `pip install tokenizers sentencepiece tiktoken` (any Python 3.9+). Run from anywhere:
  python3 tools/make_tokenizer_golden.py
The outputs are committed; rerunning with other library versions may change sp.model.
"""
import base64
import json
import os
import random
import sys

import sentencepiece as spm
import tiktoken
import tokenizers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizer")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRICKY = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "Hello world",
    " Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "It's a truth universally acknowledged; they're here, we've seen it, I'm sure, you'll see, he'd go.",
    "IT'S LOUD, THEY'RE SHOUTING, DON'T",
    "don't won't can't shan't y'all o'clock",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 co\u00f6perate \u00c5ngstr\u00f6m",
    "e\u0301 (e + combining acute) vs \u00e9",
    "\u00a0non-breaking\u00a0spaces\u2009thin\u3000ideographic",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\ud55c\uad6d\uc5b4",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u05e2\u05d1\u05e8\u05d9\u05ea \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "emoji \U0001F600\U0001F680 and flags \U0001F1EB\U0001F1F7",
    "ZWJ family \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 and skin tone \U0001F44D\U0001F3FD",
    "\U0001F9D1\u200D\U0001F4BB\u2764\ufe0f\u200d\U0001F525",
    "tabs\tand\t\ttabs",
    "lines\nand\n\nparagraphs\r\nwindows\r\n",
    "many     spaces      between",
    "   \n\t  mixed whitespace run \t\n  ",
    "digits 0123456789 and 3.14159 and 1,000,000",
    "a long number 12345678901234567890123456789",
    "year 1811, chapter XLII, page 3",
    "<s>",
    "</s>",
    "<s>hello</s>",
    "text with <s> inside and </s> too",
    "<s><s></s></s>",
    "fill  <mask>  here, <mask>and<mask> \t<mask>\n",
    "<|begin_of_text|>Llama 3 specials<|eot_id|> and <|endoftext|> <|im_start|>",
    "almost special < s > </ s> <s </s",
    "punctuation!!! ??? ... --- *** ___emphasis___ (parens) [brackets] {braces}",
    "quotes \u201cdouble\u201d \u2018single\u2019 \u00abguillemets\u00bb \u2014 em dash \u2013 en dash \u2026",
    "math \u2200x\u2208\u211d: x\u00b2 \u2265 0 \u00d7 \u00f7 \u221e",
    "code: if (x == 1) { return y->z[0]; } // comment",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.org",
    "MiXeD CaSe WoRdS and ALLCAPS and lowercase",
    "\u00bd \u2153 \u00b2 \u2460 \u0663\u0664\u0665 \u0967\u0968",
    "x",
    "\u00e9",
    "\U0001F600",
    "Elizabeth Bennet and Mr. Darcy",
]


def corpus_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def random_strings(rng, n):
    # Mixed-script strings: every kind of character above, in random order and runs.
    pool = list("abcXYZ 019'\t\n.,!?-_") + ["  ", "\u00e9", "\u00df", "\u4e2d", "\u6587",
                                             "\U0001F600", "\u200d", "\U0001F469", "\u0416",
                                             "\u00a0", "'s", "'re", "<s>", "</s>", "\r\n"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(n)]


# Llama 2's options: BPE, byte fallback, digits split, no normalization, whitespace kept.
LLAMA2_SP_OPTIONS = dict(
    vocab_size=1000, model_type="bpe", byte_fallback=True, split_digits=True,
    normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
    character_coverage=0.9995)


def train_sentencepiece(texts, out_dir, prefix="sp", **options):
    """Trains out_dir/<prefix>.model on the texts' paragraphs with `options` (default Llama 2's)."""
    # The trainer records its input and output paths in the model: relative names, from inside
    # out_dir, keep the file the same on every machine.
    cwd = os.getcwd()
    os.chdir(out_dir)
    try:
        with open(prefix + "_train.txt", "w", encoding="utf-8") as f:
            for t in texts:
                for para in t.split("\n"):
                    if para.strip():
                        f.write(para + "\n")
        spm.SentencePieceTrainer.train(
            input=prefix + "_train.txt", model_prefix=prefix, num_threads=1, minloglevel=2,
            max_sentence_length=16384, **(options or LLAMA2_SP_OPTIONS))
    finally:
        for f in (prefix + "_train.txt", prefix + ".vocab"):
            if os.path.exists(f):
                os.unlink(f)
        os.chdir(cwd)


def train_llama3_style(texts, path):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, show_progress=False,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    d = json.loads(tok.to_str())
    assert d["model"]["ignore_merges"], "ignore_merges was not kept by the trainer"
    # The older merges form, so both forms are read by the tests (data/tokenizer.json has pairs).
    d["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=1)


QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def write_split_variants(bf_json, path):
    tok = Tokenizer.from_file(bf_json)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\u00a0", behavior="removed"),
        pre_tokenizers.Split(Regex(r"\s+"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[.,;:!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{Lu}"), behavior="contiguous"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(Regex(r"[aeiou]+"), behavior="isolated", invert=True),
    ])
    tok.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True, rstrip=True)])
    with open(path, "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))


def train_qwen_style(texts, path):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    with open(path, "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))


def train_llama2_style(texts, path):
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    # Only for training, so no piece spans a word boundary (as spm_train's split_by_whitespace);
    # the saved tokenizer has no pre-tokenizer, like the converted Llama 2 files.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581[^\u2581]*|[^\u2581]+"),
                                             behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=90)
    tok.train_from_iterator(texts, trainer)
    d = json.loads(tok.to_str())
    d["pre_tokenizer"] = None
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab.setdefault("<0x%02X>" % b, len(vocab))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=1)


def train_metaspace(texts, path_always, path_first):
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                 split=True)
    tok.decoder = decoders.Sequence([
        decoders.ByteFallback(),
        decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)])
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=90)
    tok.train_from_iterator(texts, trainer)
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab.setdefault("<0x%02X>" % b, len(vocab))
    with open(path_always, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=1)
    d["pre_tokenizer"].update(prepend_scheme="first", split=False)
    d["decoder"]["decoders"][1].update(prepend_scheme="first", split=False)
    with open(path_first, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=1)


LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                    "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|reserved_special_token_4|>", "<|eot_id|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)])


def gpt2_byte_decoder():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    m, extra = {}, 256
    for b in range(256):
        if b in keep:
            m[chr(b)] = b
        else:
            m[chr(extra)] = b
            extra += 1
    return m


def write_tiktoken(llama3_json, path):
    with open(llama3_json, encoding="utf-8") as f:
        d = json.load(f)
    specials = {a["content"] for a in d["added_tokens"]}
    dec = gpt2_byte_decoder()
    items = sorted((i, t) for t, i in d["model"]["vocab"].items() if t not in specials)
    ranks = {bytes(dec[c] for c in t): r for r, (_, t) in enumerate(items)}
    with open(path, "w", encoding="ascii") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    # As MaxText's TikTokenTokenizer (after Llama 3's): specials after the ranks.
    return tiktoken.Encoding(
        name="mt_tiny_llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
        special_tokens={t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIALS)})


def train_byte_fallback(texts, path):
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+"),
                                             behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=["<s>", "</s>"],
                                  limit_alphabet=80)
    tok.train_from_iterator(texts, trainer)
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab.setdefault("<0x%02X>" % b, len(vocab))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=1)


def hf_cases(path, strings):
    tok = Tokenizer.from_file(path)
    out = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False).ids
        out.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    return tok, out


def main():
    os.makedirs(OUT, exist_ok=True)
    texts = corpus_texts(os.path.join(ROOT, "data", "corpus.train.jsonl"))
    eval_texts = corpus_texts(os.path.join(ROOT, "data", "corpus.eval.jsonl"))
    rng = random.Random(1234)
    strings = list(TRICKY)
    # Real prose: slices of held-out chapters (cut at arbitrary points, mid-word included).
    for t in eval_texts[:4]:
        a = rng.randrange(0, max(1, len(t) - 1500))
        strings.append(t[a:a + rng.randint(200, 1500)])
    strings += random_strings(rng, 24)

    train_sentencepiece(texts, OUT)
    train_llama3_style(texts, os.path.join(OUT, "llama3.json"))
    train_byte_fallback(texts, os.path.join(OUT, "bf.json"))
    write_split_variants(os.path.join(OUT, "bf.json"), os.path.join(OUT, "splits.json"))
    train_qwen_style(texts, os.path.join(OUT, "qwen.json"))
    train_llama2_style(texts, os.path.join(OUT, "llama2.json"))
    train_metaspace(texts, os.path.join(OUT, "metaspace.json"),
                    os.path.join(OUT, "metaspace_first.json"))
    enc = write_tiktoken(os.path.join(OUT, "llama3.json"), os.path.join(OUT, "tiktoken.model"))

    result = {"generator": "tools/make_tokenizer_golden.py",
              "versions": {"tokenizers": tokenizers.__version__, "sentencepiece": spm.__version__},
              "tokenizers": []}
    hf = [("gpt2_bytelevel", "data/tokenizer.json", "<s>", "</s>"),
          ("llama3_split", "tests/golden/tokenizer/llama3.json", "<|begin_of_text|>",
           "<|end_of_text|>"),
          ("byte_fallback", "tests/golden/tokenizer/bf.json", "<s>", "</s>"),
          ("split_behaviors", "tests/golden/tokenizer/splits.json", "<s>", "</s>"),
          ("qwen_nfc", "tests/golden/tokenizer/qwen.json", None, "<|endoftext|>"),
          ("llama2_hf", "tests/golden/tokenizer/llama2.json", "<s>", "</s>"),
          ("metaspace", "tests/golden/tokenizer/metaspace.json", "<s>", "</s>"),
          ("metaspace_first", "tests/golden/tokenizer/metaspace_first.json", "<s>", "</s>")]
    for name, rel, bos, eos in hf:
        tok, cases = hf_cases(os.path.join(ROOT, rel), strings)
        result["tokenizers"].append({
            "name": name, "path": rel, "type": "huggingface",
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "bos_id": tok.token_to_id(bos) if bos else -1, "eos_id": tok.token_to_id(eos),
            "cases": cases})

    cases = []
    for s in strings:
        # MaxText encodes special tokens in the text as text.
        ids = enc.encode(s, allowed_special=set(), disallowed_special=())
        cases.append({"text": s, "ids": ids, "decoded": enc.decode(ids)})
    result["tokenizers"].append({
        "name": "tiktoken_llama3", "path": "tests/golden/tokenizer/tiktoken.model",
        "type": "tiktoken", "vocab_size": enc.n_vocab,
        "bos_id": enc.encode_single_token("<|begin_of_text|>"),
        "eos_id": enc.encode_single_token("<|end_of_text|>"), "cases": cases})

    sp = spm.SentencePieceProcessor(model_file=os.path.join(OUT, "sp.model"))
    cases = []
    for s in strings:
        ids = sp.encode(s)
        cases.append({"text": s, "ids": ids, "decoded": sp.decode(ids)})
    result["tokenizers"].append({
        "name": "sentencepiece_bpe", "path": "tests/golden/tokenizer/sp.model",
        "type": "sentencepiece", "vocab_size": sp.get_piece_size(), "bos_id": sp.bos_id(),
        "eos_id": sp.eos_id(), "cases": cases})

    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for t in result["tokenizers"]:
        exact = sum(c["decoded"] == c["text"] for c in t["cases"])
        print(f"{t['name']}: vocab {t['vocab_size']}, {len(t['cases'])} cases, "
              f"{exact} decode back exactly", file=sys.stderr)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"{OUT}: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
