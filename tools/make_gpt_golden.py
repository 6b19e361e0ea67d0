#!/usr/bin/env python3
"""Tiny GPT-2 directories written by transformers 5 itself, with reference logits and token ids.

Builds two tiny random float32 GPT2LMHeadModel models, saves each with save_pretrained
(config.json in the transformers 5 form, weights as transformers 5 writes them) and records what
transformers computes for them, under tests/golden/gpt2/:

  tied/    gelu_new (tanh-approximate gelu), n_inner unset (4 x n_embd), tied embeddings (as every
           released GPT-2), and a tiny GPT-2-format tokenizer: byte-level BPE (ByteLevel
           pre-tokenizer with GPT-2's regex, no normalizer, ByteLevel decoder,
           <|endoftext|> as its one special token) trained by the `tokenizers` library on the
           shipped corpus (data/corpus.train.jsonl), 384 ids = the model's vocab_size
  untied/  activation_function "gelu" (exact, erf), n_inner 48 (not 4 x n_embd), a separate
           lm_head (tie_word_embeddings=false), layer_norm_epsilon 1e-6

Each directory holds:

  config.json, generation_config.json, model.safetensors   as save_pretrained wrote them
                        (tied/ also the tokenizer files GPT2TokenizerFast.save_pretrained wrote)
  legacy_config.json    config.json in the form of the hub's GPT-2 files (transformers 4:
                        torch_dtype, n_ctx, task_specific_params); transformers 5 reads it back to
                        a model with bit-identical logits (checked here)
  reference.safetensors input_ids I32 [1, 100], logits F32 [100, V] (eager attention, CPU, one
                        thread), generate.prompt I32 [1, 8] and generate.ids I32 [1, 28] (greedy
                        generate, do_sample=False, 20 new tokens: the prompt and the new tokens)
  reference.json        the config, seeds, init, smallest top-1/top-2 logit gap of the generate
                        run, tokenizer cases (tied/: text -> ids by GPT2TokenizerFast, and the
                        decoding of the ids), versions and the command

Weights are scaled like a trained model's, not HF's N(0, 0.02) init (whose near-uniform attention
and tiny logits would hide a lost bias or position table): token embeddings N(0, 1), the position
table N(0, 0.5), every matrix N(0, 1/fan_in) (Conv1D weights are [in, out]: fan_in is the first
dimension; lm_head [out, in]: the last), every bias 0.2 N(0, 1), LayerNorm gains 1 + 0.1 N(0, 1)
and LayerNorm biases 0.1 N(0, 1).

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_gpt_golden.py [--out tests/golden/gpt2]
"""

import argparse
import json
import os
import shutil
import tempfile

import tokenizers
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

import golden_common as gc

SEQ = 100
PROMPT_LEN, NEW_TOKENS = 8, 20
TOKENIZER_VOCAB = 384

COMMON = dict(
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=128,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    # No special tokens: greedy decoding must not stop early on a random model's "eos".
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MODELS = {
    "tied": (
        dict(COMMON, vocab_size=TOKENIZER_VOCAB, activation_function="gelu_new",
             layer_norm_epsilon=1e-5, tie_word_embeddings=True),
        2031,
    ),
    "untied": (
        dict(COMMON, vocab_size=160, activation_function="gelu", n_inner=48,
             layer_norm_epsilon=1e-6, tie_word_embeddings=False),
        2032,
    ),
}

# Tokenizer cases: the shipped corpus's register, and what byte-level BPE must get right.
TOKENIZER_TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "must be in want of a wife.",
    "Emma Woodhouse, handsome, clever, and rich",
    "  two leading spaces and trailing  ",
    "line one\nline two\n\n\ttabbed",
    "numbers 1234567 and 3.14159, dates 1811-1818",
    "don't, won't, I'm, you've, he'd, they're, we'll",
    "Unicode: café, naïve, Zürich, 東京, emoji 🙂",
    "MiXeD CaSe, ALL CAPS, punctuation!?;:()[]{}",
    "<|endoftext|>after the special token",
    "",
]


def build_tokenizer(root, out_dir):
    texts = []
    with open(os.path.join(root, "data", "corpus.train.jsonl")) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
    bpe = tokenizers.ByteLevelBPETokenizer()  # ByteLevel pre-tokenizer (GPT-2's regex), no normalizer
    bpe.train_from_iterator(texts, vocab_size=TOKENIZER_VOCAB, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    assert bpe.get_vocab_size() == TOKENIZER_VOCAB, bpe.get_vocab_size()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.json")
        bpe.save(path)
        tok = GPT2TokenizerFast(tokenizer_file=path, bos_token="<|endoftext|>",
                                eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        tok.save_pretrained(out_dir)
    tok = GPT2TokenizerFast.from_pretrained(out_dir)
    cases = []
    for t in TOKENIZER_TEXTS:
        ids = tok(t)["input_ids"]
        cases.append({"text": t, "ids": ids, "decoded": tok.decode(ids)})
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    assert tj["normalizer"] is None and tj["pre_tokenizer"]["type"] == "ByteLevel", tj
    return cases


def init(name, p, gen):
    if name.startswith("transformer.ln") or ".ln_" in name:
        base = 1.0 if name.endswith("weight") else 0.0
        p.copy_(base + 0.1 * gc.randn(p, gen))
    elif name == "transformer.wte.weight":
        p.copy_(gc.randn(p, gen))
    elif name == "transformer.wpe.weight":
        p.copy_(0.5 * gc.randn(p, gen))
    elif p.dim() == 1:
        p.copy_(0.2 * gc.randn(p, gen))
    elif name == "lm_head.weight":  # nn.Linear [out, in]
        p.copy_(gc.randn(p, gen) / p.shape[1] ** 0.5)
    else:  # Conv1D [in, out]
        p.copy_(gc.randn(p, gen) / p.shape[0] ** 0.5)


def legacy_form(cfg):
    """transformers 5's config.json dict in the form of the hub's GPT-2 files (transformers 4)."""
    out = gc.legacy_form(cfg)  # GPT-2's config has no rope_parameters
    out["n_ctx"] = cfg["n_positions"]
    out["task_specific_params"] = {"text-generation": {"do_sample": True, "max_length": 50}}
    return out


def make(name, out, root, command):
    cfg, seed = MODELS[name]
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    model = gc.build(GPT2Config, GPT2LMHeadModel, cfg, seed, init)
    num_parameters = gc.save_model(model, d)
    del model
    cases = build_tokenizer(root, d) if name == "tied" else None

    input_ids, prompt = gc.random_inputs(seed, cfg["vocab_size"], SEQ, PROMPT_LEN)

    # Everything from here on is computed from the saved directory, as a user would load it.
    m = gc.load(GPT2LMHeadModel, d)
    config_json = gc.read_config(d, tf5_form=False)
    logits = gc.logits_of(m, input_ids)
    gen_ids, gen_margin = gc.generate(m, prompt, NEW_TOKENS)
    weight_names = gc.weight_names(d)
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "logits": logits,
        "generate.prompt": prompt.to(torch.int32),
        "generate.ids": gen_ids.to(torch.int32),
    }
    gc.write_json(os.path.join(d, "legacy_config.json"), legacy_form(config_json))
    old_logits = gc.logits_with_config(
        GPT2LMHeadModel, d, os.path.join(d, "legacy_config.json"), input_ids, files=["model.safetensors"]
    )
    assert torch.equal(old_logits, logits), "legacy config: other logits"

    tensors = gc.save_tensors(os.path.join(d, "reference.safetensors"), tensors)
    gc.chmod_tree(d)
    sizes = gc.file_sizes(d)
    info = {
        "hf_class": "GPT2LMHeadModel",
        "attn_implementation": "eager",
        "config_json": config_json,
        "seed": seed,
        "init": "wte N(0, 1); wpe 0.5 N(0, 1); matrices N(0, 1/fan_in); biases 0.2 N(0, 1); "
        "LayerNorm gains 1 + 0.1 N(0, 1), biases 0.1 N(0, 1)",
        "num_parameters": num_parameters,
        "weights": weight_names,
        "input": {"seq": SEQ},
        "generate": gc.generate_info(prompt, gen_ids, gen_margin, NEW_TOKENS),
        "max_abs_logit": logits.abs().max().item(),
        "tensors": gc.tensor_list(tensors),
        "file_sizes": sizes,
        "versions": gc.versions(tokenizers),
        "command": command,
    }
    if cases is not None:
        info["tokenizer_cases"] = cases
    gc.write_reference_json(os.path.join(d, "reference.json"), info, lists=None)
    print(f"{d}: {sum(sizes.values())} bytes; {num_parameters} parameters; margin {gen_margin:.4g}; "
          f"max |logit| {logits.abs().max().item():.3g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = gc.repo_root()
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", "gpt2"))
    args = ap.parse_args()
    command = gc.setup("make_gpt_golden.py")
    for name in MODELS:
        make(name, args.out, root, command)


if __name__ == "__main__":
    main()
