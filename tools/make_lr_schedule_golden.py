#!/usr/bin/env python3
"""Reference learning rates for Trainer.LearningRateScheduleIsMaxTexts (tests/unit/trainer_test.cpp).

Builds MaxText's schedule (maxtext_utils.create_learning_rate_schedule as of MaxText commit
31015aaf5, "Fix learning rate schedule", 2026-02-05: the warm-up's linear_schedule over
warmup_steps transitions, the cosine over its length - 1) from optax's own pieces: linear_schedule, constant_schedule and
join_schedules, which decide the count each piece sees and where the pieces meet. optax
evaluates a schedule at the number of updates done, so step s (1-based) of a run takes the
value at count s - 1. Prints one C++ initializer per case; float64 throughout (jax x64).

    python3 -m venv /tmp/v && /tmp/v/bin/pip install jax optax
    /tmp/v/bin/python tools/make_lr_schedule_golden.py
"""
import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402


def cosine(init_lr, final_lr, length):
    def f(count):
        pct = count / (length - 1) if length > 1 else 1.0
        a = 0.5 * (jnp.cos(jnp.pi * pct) + 1)
        return init_lr * a + final_lr * (1 - a)
    return f


def schedule(steps, peak, warmup_fraction, final_fraction, schedule_steps=-1, kind="cosine",
             decay_fraction=0.1, decay_style="linear"):
    total = steps if schedule_steps < 0 else schedule_steps
    final = peak * final_fraction
    warmup = int(total * warmup_fraction)
    pieces, bounds = [], []
    if warmup > 0:
        pieces.append(optax.linear_schedule(0.0, peak, warmup))
        bounds.append(warmup)
    if kind == "cosine":
        if total - warmup > 0:
            pieces.append(cosine(peak, final, total - warmup))
            bounds.append(total)
    else:
        decay = int(total * decay_fraction)
        stable = total - warmup - decay
        if stable > 0:
            pieces.append(optax.constant_schedule(peak))
            bounds.append(warmup + stable)
        if decay > 0:
            pieces.append(optax.linear_schedule(peak, final, decay - 1) if decay_style == "linear"
                          else cosine(peak, final, decay))
            bounds.append(total)
    if steps - total > 0:
        pieces.append(optax.constant_schedule(0.0))
        bounds.append(total)
    # join_schedules takes the boundaries between pieces: one fewer than the pieces.
    s = optax.join_schedules(pieces, bounds[:len(pieces) - 1])
    return [float(s(c)) for c in range(steps)]


CASES = [
    ("steps=20 warmup 0.1 final 0.1", dict(steps=20, peak=1.0, warmup_fraction=0.1,
                                           final_fraction=0.1)),
    ("steps=25 schedule 15 warmup 0.25 final 0.2", dict(steps=25, peak=2e-3, warmup_fraction=0.25,
                                                        final_fraction=0.2, schedule_steps=15)),
    ("steps=10 warmup 0.1 (one step)", dict(steps=10, peak=1.0, warmup_fraction=0.1,
                                            final_fraction=0.1)),
    ("steps=1", dict(steps=1, peak=1.0, warmup_fraction=0.1, final_fraction=0.1)),
    ("wsd linear steps=20 warmup 0.1 decay 0.25 final 0", dict(
        steps=20, peak=1.0, warmup_fraction=0.1, final_fraction=0.0, kind="wsd",
        decay_fraction=0.25)),
    ("wsd cosine steps=32 schedule 30 warmup 0.2 decay 0.3 final 0.1", dict(
        steps=32, peak=1.0, warmup_fraction=0.2, final_fraction=0.1, schedule_steps=30,
        kind="wsd", decay_fraction=0.3, decay_style="cosine")),
]

for name, kw in CASES:
    print(f"// {name}")
    print("{" + ", ".join(repr(v) for v in schedule(**kw)) + "},")
