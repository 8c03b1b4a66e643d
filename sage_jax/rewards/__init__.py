"""Host-side verifiers (`verifiers`, run in a process pool by `pool`), the bridge from the jitted step
(`host`) and boxed-answer parsing (`boxed`).

`sage_jax.rewards.math_verify_reward` is the interface docs/design.md §6 keeps stable.
"""

from sage_jax.rewards.verifiers import math_verify_reward

__all__ = ["math_verify_reward"]
