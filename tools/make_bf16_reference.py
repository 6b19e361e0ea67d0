#!/usr/bin/env python3
"""What transformers computes in bfloat16 for golden directories: the bar mt's bf16 is held to.

A tiny random model's bfloat16 logits differ from its float32 ones by bf16 rounding alone, and
by how much depends on the model: Gemma 2's golden model, whose soft-caps bite by design, moves
by about 4.6% of its largest logit in transformers' own bfloat16, Gemma 1's by 0.7%. A fixed
tolerance for mt's bfloat16 would be too loose for one and too tight for the other, so the tests
ask instead that mt in bfloat16 stay as close to the float32 reference as transformers in
bfloat16 does. This tool records transformers' side: for each directory given (a golden
directory holding config.json, model.safetensors and reference.safetensors with input_ids and
float32 logits), it loads the model in bfloat16 (eager attention, the implementation that
soft-caps), scores the reference input and writes

  <dir>/bf16_reference.safetensors   logits [T, V] float32 (the bf16 model's, widened)
  <dir>/bf16_reference.json          versions, the command, and the measured error against the
                                     float32 logits (max |bf16 - f32| / max |f32|)

Run it with the pinned environment of tools/setup_reference_env_tf5.sh:
  .venv-tf5/bin/python tools/make_bf16_reference.py tests/golden/gemma tests/golden/gemma2 ...
"""
import json
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file


def main(dirs):
    for d in dirs:
        ref = load_file(f"{d}/reference.safetensors")
        ids = ref["input_ids"].astype(np.int64).reshape(1, -1)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.bfloat16, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(ids)).logits.float().numpy()[0]
        f32 = ref["logits"].reshape(logits.shape)
        err = float(np.abs(logits - f32).max() / np.abs(f32).max())
        save_file({"logits": np.ascontiguousarray(logits, dtype=np.float32)},
                  f"{d}/bf16_reference.safetensors")
        with open(f"{d}/bf16_reference.json", "w") as f:
            json.dump({
                "what": "transformers' logits with the model in bfloat16 (eager attention) for "
                        "reference.safetensors' input_ids",
                "max_abs_error_over_max_abs_f32_logit": err,
                "versions": {"torch": torch.__version__,
                             "transformers": transformers.__version__},
                "command": " ".join(["tools/make_bf16_reference.py"] + dirs),
            }, f, indent=1)
            f.write("\n")
        print(f"{d}: transformers bf16 vs f32 logits: {err:.3e} of the largest")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
