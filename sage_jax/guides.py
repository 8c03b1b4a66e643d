"""Alias of `sage_jax.rl.guides` for the interface docs/design.md §6 keeps stable."""

from sage_jax.rl.guide_configs import cosine_schedule
from sage_jax.rl.guides import branch_q, random_q, token_q

__all__ = ["branch_q", "cosine_schedule", "random_q", "token_q"]
