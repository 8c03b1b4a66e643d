"""Evaluation: the one path (sampling, verifying, pass@k with CIs, reports) used in training and by `mode=eval`."""
