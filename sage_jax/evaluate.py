"""Alias of `sage_jax.eval.metrics.pass_at_k` for the interface docs/design.md §6 keeps stable."""

from sage_jax.eval.metrics import pass_at_k

__all__ = ["pass_at_k"]
