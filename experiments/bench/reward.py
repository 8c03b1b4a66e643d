"""The benchmark's reward: a trivial, cheap function of the completion text, shared by both sides."""

import numpy as np


def count_ones(completions, answers=None):
    """Dense toy reward (fraction of '1' characters, scaled) so every group has reward variance."""
    return np.array([c.count("1") / 4.0 for c in completions], np.float32)
