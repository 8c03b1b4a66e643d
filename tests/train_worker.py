"""`python -m sage_jax.main` with a paced reward, so a test can kill or signal it between steps.

SLOW_REWARD_S seconds of sleep per reward call (per step) give the test a window after each step.
"""

import os
import sys
import time

from absl import app

from sage_jax import rewards


def _slow_exact_match(completions, answers):
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "0.3")))
    return rewards.exact_match_reward(completions, answers)


rewards.register_reward("slow_exact_match", _slow_exact_match)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sage_jax import main

    app.run(main.main)
