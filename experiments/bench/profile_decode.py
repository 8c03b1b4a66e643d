"""Where the rollout's time goes (not a test): decode cost against rows and cache slots, and a per-op profile.

    .venv/bin/python experiments/bench/profile_decode.py [--ckpt /tmp/sage_bench/ckpt_tiny] [--T 64]

Uses the benchmark's tiny checkpoint (written by `bench.py` into its workdir; made here if missing).
Prints three measured tables, all from one process with the variants interleaved:

1. rollout time per decode step as the rows B grow (P = 16): flat = dispatch-bound, linear = compute;
2. the same as the prompt length P grows (B = 64), less the prefill (a T = 1 rollout): the slope is the
   cost of attending over more cache slots;
3. one traced rollout (`jax.profiler`), thunk time summed by the HLO op it came from (`op_name` metadata)
   and the 10 costliest thunks. Thunks run on 2 threads, so their sum can exceed the wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root: studies import each other as experiments.<study>

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from sage_jax.models import hf  # noqa: E402
from sage_jax.sampling import SamplingConfig, generate  # noqa: E402


def rollout_fn(graphdef, state, B, P, T):
    cfg = SamplingConfig(max_new_tokens=T, temperature=1.0, eos_ids=(), pad_id=0)  # full length, as bench.py
    prompt = jnp.full((B, P), 5, jnp.int32)
    fn = jax.jit(lambda st, key: generate(nnx.merge(graphdef, st), prompt, jnp.ones_like(prompt), key, cfg).tokens_BxT)
    return fn, (lambda key: fn(state, key))


def interleaved(fns: dict, reps: int = 5) -> dict:
    for f in fns.values():  # compile
        jax.block_until_ready(f(jax.random.key(0)))
    times = {k: [] for k in fns}
    for r in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(jax.random.key(r + 1)))
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def thunk_times(run, shares: bool = False):
    """(wall s, seconds per XLA:CPU thunk name) of one traced call of `run()` (already compiled); with
    `shares`, also each thunk's share of the wall: while k thunks run at once, each is charged 1/k of the time,
    so the shares add up to the time any thunk ran and a thunk slowed by a concurrent one is not charged twice."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        jax.block_until_ready(run())
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        path = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))[-1]
        events = json.load(gzip.open(path))["traceEvents"]
    spans = [(e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("ph") == "X" and not e["name"].startswith(("Thunk", "$"))]
    per_thunk = collections.Counter()
    for name, start, end in spans:
        per_thunk[name] += (end - start) / 1e6
    return (wall, per_thunk, wall_shares(spans)) if shares else (wall, per_thunk)


def wall_shares(spans) -> collections.Counter:
    """Per name, the sum over its (name, start, end) spans of 1 / (spans running at that instant) dt, in s."""
    edges = sorted({t for _, s, e in spans for t in (s, e)})
    out = collections.Counter()
    if len(edges) < 2:
        return out
    index = {t: i for i, t in enumerate(edges)}
    count = [0] * len(edges)  # spans running in [edges[i], edges[i + 1])
    for _, s, e in spans:
        for i in range(index[s], index[e]):
            count[i] += 1
    for name, s, e in spans:
        out[name] += sum((edges[i + 1] - edges[i]) / count[i] for i in range(index[s], index[e])) / 1e6
    return out


def op_profile(jitted, state, hlo_text: str):
    jax.block_until_ready(jitted(state, jax.random.key(1)))
    wall, per_thunk = thunk_times(lambda: jitted(state, jax.random.key(2)))

    def origin(name):  # (result shape, the jax op that produced the thunk)
        m = re.search(r"%" + re.escape(name) + r" = (\S+) [^\n]*?op_name=\"([^\"]+)\"", hlo_text)
        return (m.group(1), m.group(2).split("/")[-1]) if m else ("?", "?")

    by_op = collections.Counter()
    for k, v in per_thunk.items():
        by_op[origin(k)[1]] += v
    return wall, per_thunk, by_op, origin


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/sage_bench/ckpt_tiny")
    ap.add_argument("--T", type=int, default=64)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.ckpt, "model.safetensors")):
        from experiments.bench.step_setup import write_checkpoint
        args.ckpt = write_checkpoint("tiny", os.path.dirname(args.ckpt))
    model, _ = hf.load(args.ckpt)
    graphdef, state = nnx.split(model)
    T = args.T
    print(f"{args.ckpt}, T = {T}, load average {os.getloadavg()[0]:.2f}")

    print("\n| B (P = 16) | rollout ms | ms / decode step | us / row / step |\n|---|---|---|---|")
    rows = interleaved({B: rollout_fn(graphdef, state, B, 16, T)[1] for B in (1, 8, 64, 256)})
    for B, s in rows.items():
        print(f"| {B} | {s * 1e3:.1f} | {s / T * 1e3:.2f} | {s / T / B * 1e6:.1f} |")

    # Prefill (a T = 1 rollout) grows with P too; subtract it so the slope is the decode steps' own.
    print("\n| P (B = 64) | cache slots S | rollout ms | prefill ms | ms / decode step |\n|---|---|---|---|---|")
    fns = {}
    for P in (16, 80, 208):
        fns[(P, T)] = rollout_fn(graphdef, state, 64, P, T)[1]
        fns[(P, 1)] = rollout_fn(graphdef, state, 64, P, 1)[1]
    timed = interleaved(fns)
    step = {}
    for P in (16, 80, 208):
        full, pre = timed[(P, T)], timed[(P, 1)]
        step[P] = (full - pre) / (T - 1)
        print(f"| {P} | {P + T} | {full * 1e3:.1f} | {pre * 1e3:.1f} | {step[P] * 1e3:.2f} |")
    slope = (step[208] - step[16]) / (208 - 16)
    print(f"\nper decode step: {slope * 1e6:.1f} us per cache slot; at S = {16 + T} that is "
          f"{slope * (16 + T) / step[16]:.0%} of the step")

    jitted, _ = rollout_fn(graphdef, state, 64, 16, T)
    hlo = jitted.lower(state, jax.random.key(0)).compile().as_text()
    wall, per_thunk, by_op, origin = op_profile(jitted, state, hlo)
    total = sum(per_thunk.values())
    print(f"\nTraced rollout B = 64, P = 16: wall {wall * 1e3:.1f} ms, thunks summed {total * 1e3:.1f} ms\n")
    print("| op (jax) | thunk ms | share |\n|---|---|---|")
    for op, v in by_op.most_common(8):
        print(f"| {op} | {v * 1e3:.1f} | {v / total:.0%} |")
    print("\n| thunk | result | op | ms |\n|---|---|---|---|")
    for k, v in per_thunk.most_common(10):
        shape, op = origin(k)
        print(f"| {k} | `{shape}` | {op} | {v * 1e3:.1f} |")


if __name__ == "__main__":
    main()
