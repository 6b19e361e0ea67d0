#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with the tensorboard package and checks them.

mt writes its event files itself (core/src/tensorboard.cpp: the TFRecord framing and the Event
protobufs are encoded by hand). This reads them the way TensorBoard does, through
EventAccumulator, whose reader checks every record's CRCs and whose protobuf parser is the real
one, then prints each scalar tag and checks that:
  - MaxText's tags that mt writes are all there (eval/avg_loss when the run evaluated);
  - every value is finite, and the steps of each tag increase;
  - the steps and values agree with the run's metrics.jsonl (as float32; for a step written
    twice, by a run killed after its last checkpoint and its resumed run, the later line).

Needs only the tensorboard package (PyPI), in any venv:
    python3 -m venv build/venv-tb && build/venv-tb/bin/pip install tensorboard
    build/venv-tb/bin/python tools/check_tensorboard.py out/default
Exits 1 with the reason when a check fails.
"""

import argparse
import json
import math
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# TensorBoard tag -> metrics.jsonl field.
TAGS = {
    "learning/loss": "loss",
    "learning/current_learning_rate": "learning_rate",
    "learning/grad_norm": "grad_norm",  # after clipping, as MaxText's
    "learning/raw_grad_norm": "raw_grad_norm",
    "learning/total_weights": "total_weights",
    "perf/step_time_seconds": None,  # metrics.jsonl has step_time_ms
    "perf/per_device_tokens_per_sec": "tokens_per_sec",
    "perf/per_device_tflops_per_sec": "tflops_per_device",
    "perf/mfu": "mfu",
}
EVAL_TAG = "eval/avg_loss"


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fail(msg):
    print("check_tensorboard: FAILED: " + msg)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="<base_output_directory>/<run_name>")
    args = ap.parse_args()
    run_name = os.path.basename(os.path.normpath(args.run_dir))
    tb_dir = os.path.join(args.run_dir, "tensorboard", run_name)
    files = sorted(f for f in os.listdir(tb_dir) if "tfevents" in f) if os.path.isdir(tb_dir) else []
    if not files:
        fail(f"no event files in {tb_dir}")
    print(f"{tb_dir}: {len(files)} event file(s): {', '.join(files)}")

    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])

    metrics = {}
    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                m = json.loads(line)
                metrics[m["step"]] = m  # the later line of a step written twice
    evaluated = any("eval_loss" in m for m in metrics.values())

    expected = set(TAGS) | ({EVAL_TAG} if evaluated else set())
    if not expected <= set(tags):
        fail(f"tags missing: {sorted(expected - set(tags))}")

    print(f"{'tag':34} {'events':>6}  {'first step: value':>24}  {'last step: value':>24}")
    for tag in tags:
        ev = acc.Scalars(tag)
        steps = [e.step for e in ev]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            fail(f"{tag}: steps do not increase: {steps}")
        for e in ev:
            if not math.isfinite(e.value):
                fail(f"{tag} at step {e.step}: {e.value}")
        first, last = ev[0], ev[-1]
        print(f"{tag:34} {len(ev):6}  {first.step:>8}: {first.value:<14.6g}  "
              f"{last.step:>8}: {last.value:<14.6g}")

        field = TAGS.get(tag, "eval_loss" if tag == EVAL_TAG else None)
        if field is None:
            continue
        want = {s: m[field] for s, m in metrics.items() if field in m}
        if set(steps) != set(want):
            fail(f"{tag}: steps {sorted(set(steps) ^ set(want))} are in only one of the event "
                 "files and metrics.jsonl")
        for e in ev:
            # metrics.jsonl rounds some fields (learning_rate to 6 digits, mfu to 5 decimals).
            if not math.isclose(e.value, f32(want[e.step]), rel_tol=1e-5, abs_tol=1e-5):
                fail(f"{tag} at step {e.step}: {e.value} in the events, {want[e.step]} in "
                     "metrics.jsonl")
    print(f"check_tensorboard: OK: {len(tags)} tags over steps {min(metrics)}..{max(metrics)} "
          "match metrics.jsonl")


if __name__ == "__main__":
    main()
