#!/usr/bin/env python3
"""Writes a GGUF file for llama.cpp from a Hugging Face directory exported by mt (random weights).

    llamacpp_gguf.py --llama-cpp DIR --input HF_DIR --outtype f32|bf16|q8_0 --outfile OUT.gguf

The tensors go through the llama.cpp checkout's own converter (its conversion package, as
convert_hf_to_gguf.py uses it), so every name, split and permutation (for example DeepSeek-V2's
kv_b_proj split into k_b and v_b for latent attention) is llama.cpp's. Only the vocabulary is
ours: mt's export of a random model has no tokenizer, and the converter insists on one (for the
byte-level BPE families it even checks a hash of known pre-tokenizers). This script replaces the
model class's set_vocab with a synthetic SentencePiece-style ("llama") vocabulary of exactly
vocab_size entries: <unk>, <s>, </s>, the 256 byte tokens when there is room, then placeholders.
llama-bench feeds token ids only, so what the tokens spell does not matter.
"""
import argparse
import json
import logging
import sys
from pathlib import Path


def synthetic_vocab(gguf, writer, n_vocab: int) -> None:
    tokens = [b"<unk>", b"<s>", b"</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    if n_vocab >= len(tokens) + 256:
        tokens += [f"<0x{b:02X}>".encode() for b in range(256)]
        types += [gguf.TokenType.BYTE] * 256
    while len(tokens) < n_vocab:
        tokens.append(f"\u2581t{len(tokens)}".encode())
        types.append(gguf.TokenType.NORMAL)
    tokens, types = tokens[:n_vocab], types[:n_vocab]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(n_vocab)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source checkout")
    ap.add_argument("--input", required=True, type=Path, help="Hugging Face directory (mt convert --to=hf)")
    ap.add_argument("--outtype", required=True, choices=["f32", "bf16", "q8_0"])
    ap.add_argument("--outfile", required=True, type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    # The checkout's gguf-py and conversion package, not whatever gguf is installed.
    sys.path.insert(0, str(args.llama_cpp / "gguf-py"))
    sys.path.insert(0, str(args.llama_cpp))
    import gguf
    import torch

    # Debian's PyTorch (1.13, python3-torch) predates the float8 dtypes the converter's dtype
    # tables name; mt's exports hold f32 and bf16 only, so a stand-in lets those tables build.
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if not hasattr(torch, name):
            setattr(torch, name, torch.uint8)
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    n_vocab = json.loads((args.input / "config.json").read_text())["vocab_size"]
    hparams = ModelBase.load_hparams(args.input, False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    base = get_model_class(arch, mmproj=False)

    class WithSyntheticVocab(base):
        model_arch = base.model_arch  # the converter asks every subclass to name it

        def set_vocab(self):
            synthetic_vocab(gguf, self.gguf_writer, n_vocab)

        def set_gguf_parameters(self):
            super().set_gguf_parameters()
            family = self.hparams.get("model_type")
            if family in ("deepseek_v2", "deepseek_v3") and self.hparams.get("q_lora_rank") is None:
                # No query compression: llama.cpp reads the missing rank as "V2-Lite" only at
                # V2-Lite's layer count (27) and otherwise demands the key; 0 says "none".
                self.gguf_writer.add_q_lora_rank(0)
            if family == "deepseek_v3" and "scoring_func" not in self.hparams:
                # DeepSeek's own V3 config.json says scoring_func: sigmoid (transformers' V3
                # router always is); without it llama.cpp falls back to V2's softmax.
                self.gguf_writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    # Gemma's converter trims token_embd to the tokenizer's vocabulary, which it counts from
    # tokenizer.json (or tokenizer.model); mt's export has neither: a stand-in of exactly
    # vocab_size entries keeps every row.
    stand_in = args.input / "tokenizer.json"
    if not stand_in.exists() and not (args.input / "tokenizer.model").exists():
        stand_in.write_text(json.dumps(
            {"model": {"vocab": {f"<t{i}>": i for i in range(n_vocab)}}, "added_tokens": []}))

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[args.outtype]
    args.outfile.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        model = WithSyntheticVocab(args.input, ftype, args.outfile, model_name=args.input.name)
        model.write()
    print(f"llamacpp_gguf: {arch} ({base.__name__}), {n_vocab} synthetic tokens -> {args.outfile}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
