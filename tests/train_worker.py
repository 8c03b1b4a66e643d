"""`python -m sage_jax.main` with a paced reward, so a test can kill or signal it between steps.

SLOW_REWARD_S seconds of sleep per reward call (per step) give the test a window after each step.
"""

import os
import sys
import time

from sage_jax.rewards import verifiers as rewards


def _slow_exact_match(completions, answers):
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "0.3")))
    return rewards.exact_match_reward(completions, answers)


rewards.register_reward("slow_exact_match", _slow_exact_match)


def _crash_at(n: int) -> None:
    """CRASH_AT_BATCH=N: the data iterator raises when batch N is drawn (a crash mid-training, with an
    asynchronous checkpoint save possibly under way)."""
    from sage_jax.train import data as train_data
    make = train_data.prompt_iterator

    class Crashing:
        def __init__(self, it):
            self.it, self.k = it, 0

        def __next__(self):
            self.k += 1
            if self.k == n:
                raise RuntimeError(f"injected crash at batch {n}")
            return next(self.it)

        def __getattr__(self, name):
            return getattr(self.it, name)

    train_data.prompt_iterator = lambda *a, **k: Crashing(make(*a, **k))


if os.environ.get("CRASH_AT_BATCH"):
    _crash_at(int(os.environ["CRASH_AT_BATCH"]))

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sage_jax import main

    main.cli()
