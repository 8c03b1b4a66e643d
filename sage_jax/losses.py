"""Alias of `sage_jax.rl.losses` for the interface docs/design.md §6 keeps stable."""

from sage_jax.rl.losses import per_token_kl

__all__ = ["per_token_kl"]
