"""The forward-KL baseline's per-position term, KL(pi_ref || pi_theta) exact over the vocabulary, in sequence
chunks (never the full float32 [B, T, V] logits of either model).

Dimension key: B rows, S = P + T sequence, P prompt length, T completion length, D model, V vocab, C chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sage_jax.models.decoder import positions_from_mask
from sage_jax.policy.logprobs import map_position_chunks
from sage_jax.rl.losses import forward_kl_from_logits

Array = jax.Array


def sequence_forward_kl(policy, reference, tokens_BxS: Array, mask_BxS: Array, completion_start: int,
                        chunk: int = 256, temperature: float = 1.0, remat: str | None = None) -> Array:
    """Exact forward KL(pi_ref || pi_theta) at every completion position (BxT), in sequence chunks: the
    full-vocabulary sum of `losses.forward_kl_from_logits` on both models' chunk logits. Differentiable in
    the policy; the reference is stop-gradient."""
    pos = positions_from_mask(mask_BxS)
    h_pol = policy.forward(tokens_BxS, pos, mask_BxS, remat=remat)[0][:, completion_start - 1:-1]
    h_ref = jax.lax.stop_gradient(reference.forward(tokens_BxS, pos, mask_BxS)[0][:, completion_start - 1:-1])
    w_pol, w_ref = policy.unembed_matrix(), jax.lax.stop_gradient(reference.unembed_matrix())

    def kl(hp, hr):
        lp = jnp.einsum("bcd,dv->bcv", hp, w_pol, preferred_element_type=jnp.float32) / temperature
        lr = jnp.einsum("bcd,dv->bcv", hr, w_ref, preferred_element_type=jnp.float32) / temperature
        return (forward_kl_from_logits(lp, lr),)

    return map_position_chunks(kl, (h_pol, h_ref), chunk)[0]
