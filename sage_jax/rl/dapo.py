"""DAPO's sample-level parts (Yu et al., 2025, arXiv 2503.14476): dynamic sampling and overlong handling.

Dimension key (docs/design.md §5.4): B rows (group-contiguous, G per prompt), N prompts kept for the update;
k = rl.dynamic_sampling, so k x N groups are generated.

Dynamic sampling. A group whose rewards are all equal has zero advantage: it carries no policy-gradient
signal, only KL terms. DAPO keeps sampling until the batch holds N groups with unequal rewards. Inside one
fixed-shape program this is done by over-sampling: the step generates k x N groups, ranks the
informative ones first (in batch order, so the choice is deterministic) and trains on the first N. When
fewer than N are informative, the remaining slots hold uninformative groups whose rows are masked out of
the loss (they change neither the loss nor its token count) and an update left with none is no optimizer step:
the step trains on fewer groups. verl instead samples again, up to `max_num_gen_batches`, and raises when that
is reached short; a fixed-shape program cannot loop on the host, so the shortfall is counted
(`dynamic/short_groups`) instead. Rewards of the verifier (before any length penalty) decide what is
informative, as verl's DAPO recipe filters on `acc`.

Overlong reward shaping, with L_max = rollout.max_new_tokens and a buffer L_c (DAPO eq. 13, verl's
`overlong_buffer`):

    R_len(|y|) = 0                               |y| <= L_max - L_c
               = ((L_max - L_c) - |y|) / L_c     L_max - L_c < |y| <= L_max
    R = R_verifier + factor * R_len              (a truncated completion has |y| = L_max: R_len = -1)

Overlong filtering masks truncated completions (no end-of-sequence token within L_max) out of the loss;
they still count in their group's advantage statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def overlong_penalty(lengths_B: Array, max_len: int, buffer: int, factor: float = 1.0) -> Array:
    """factor * R_len(|y|) per row (<= 0); lengths in completion tokens (EOS included)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer} must be in (0, max_new_tokens={max_len}]")
    excess = lengths_B.astype(jnp.float32) - (max_len - buffer)
    return factor * jnp.minimum(-excess / buffer, 0.0)


def select_groups(rewards_B: Array, group_size: int, keep: int,
                  informative_G: Array | None = None) -> tuple[Array, Array, dict[str, Array]]:
    """The `keep` groups to train on: the informative ones first, in batch order, then the others. Informative:
    unequal rewards, or `informative_G` where given (the pass@k advantage's groups with a signal).

    Returns (group indices [keep], whether each is informative [keep], metrics). Metrics, in groups:
    `generated`, `informative`, `kept` (informative and trained on), `short` (slots left to masked
    uninformative groups), `surplus` (informative groups beyond `keep`, not trained on).
    """
    (B,) = rewards_B.shape
    n_groups = B // group_size
    if B % group_size or not 1 <= keep <= n_groups:
        raise ValueError(f"select_groups: {B} rows in groups of {group_size}, keep={keep}")
    r = rewards_B.reshape(n_groups, group_size)
    informative = r.max(axis=1) > r.min(axis=1)  # exact, unlike a tolerance on a float std
    if informative_G is not None:
        informative = informative_G
    order = jnp.argsort(jnp.logical_not(informative).astype(jnp.int32), stable=True)
    idx = order[:keep]
    n_inf = informative.sum()
    kept = jnp.minimum(n_inf, keep)
    metrics = {"generated": jnp.asarray(n_groups, jnp.int32), "informative": n_inf, "kept": kept, "short": keep - kept,
               "surplus": n_inf - kept}
    return idx, informative[idx], metrics


def group_rows(group_idx: Array, group_size: int) -> Array:
    """Row indices of the given groups, group-contiguous: [len(group_idx) * group_size]."""
    return (group_idx[:, None] * group_size + jnp.arange(group_size)).reshape(-1)
