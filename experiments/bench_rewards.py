"""Throughput of the math-verify reward pool (verifications per second).

    .venv/bin/python experiments/bench_rewards.py --n=2048 --workers=2

Completions are ~1.8k characters of working ending in a boxed answer (integers, fractions,
radicals, intervals, decimals, polynomials with random coefficients, so that parse caches rarely
hit), about half right, each gold answer shared by a group of 8 completions as in GRPO. Prints one line per repeat and the median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from sage_jax.rewards.pool import VerifierPool

# Answer shapes; the numbers are drawn per group so that parse caches rarely hit.
FORMS = ["{a}", "\\frac{{{a}}}{{{b}}}", "{a}\\sqrt{{{b}}}", "({a},{b}]", "\\frac{{{a}\\pi}}{{{b}}}",
         "-{a}", "{a}.{b}", "x^2+{a}x+{b}"]
FILLER = ("We expand the expression and collect like terms; then we substitute the known values "
          "and simplify step by step, checking each intermediate result. ")


def make_batch(n: int, group: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    comps, golds = [], []
    for g in range(0, n, group):
        form = FORMS[(g // group) % len(FORMS)]
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        gold = form.format(a=a, b=b)
        for _ in range(min(group, n - g)):
            wrong = rng.random() < 0.5
            ans = form.format(a=a + rng.randint(1, 9), b=b) if wrong else gold
            comps.append(FILLER * 12 + f"Therefore the answer is $\\boxed{{{ans}}}$.")
            golds.append(gold)
    return comps, golds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout_s", type=float, default=5.0)
    args = ap.parse_args()
    with VerifierPool(num_workers=args.workers, timeout_s=args.timeout_s) as pool:
        pool.verify(*make_batch(256, args.group, seed=10_000))  # start and warm the workers
        rates = []
        for r in range(args.repeats):
            comps, golds = make_batch(args.n, args.group, seed=r)  # fresh answers: no cache hits
            t0 = time.perf_counter()
            rewards, stats = pool.verify(comps, golds)
            dt = time.perf_counter() - t0
            rates.append(args.n / dt)
            print(f"repeat {r}: {args.n} verifications in {dt:.2f}s = {rates[-1]:.0f}/s "
                  f"(mean reward {rewards.mean():.3f}, timeouts {stats.timeouts}, "
                  f"errors {stats.errors})")
        print(f"median: {statistics.median(rates):.0f} verifications/s with "
              f"{pool.num_workers} workers")


if __name__ == "__main__":
    main()
