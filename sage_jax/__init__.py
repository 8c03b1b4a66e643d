"""sage_jax: pure-JAX RLVR for LLMs (SAGE and the GRPO family)."""
