"""The bridge between the jitted step and host verifiers.

Inside jit, `host_rewards` calls the verifier through `jax.pure_callback`; under a mesh it does so
inside `shard_map`, so each host verifies only the rows of the shards it owns (sharded and
multi-host). The host side decodes tokens to text and applies the reward function; a reward function
that raises or returns NaN / inf for a sample gives that sample 0 and flags it, and training goes on.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sage_jax import sharding as shd
from sage_jax.rewards.verifiers import FAIL_NAMES, FAIL_RAISED

RewardFn = Callable[[Sequence[str], Sequence[str]], np.ndarray]  # (completions, answers) -> float32 [B]
ANSWER_PAD = -1  # answer token arrays are right-padded with this

log = logging.getLogger(__name__)


def encode_answers(tokenizer, answers: Sequence[str], length: int) -> np.ndarray:
    """Gold answers as int32 token rows (so they travel with the batch through jit and sharding)."""
    out = np.full((len(answers), length), ANSWER_PAD, np.int32)
    for i, a in enumerate(answers):
        ids = tokenizer(a, add_special_tokens=False)["input_ids"]
        if len(ids) > length:
            raise ValueError(f"answer {i} ({a[:40]!r}) is {len(ids)} tokens, longer than data.max_answer_tokens={length}")
        out[i, :len(ids)] = ids
    return out


class HostReward:
    """Host function: (tokens_BxT, mask_BxT, answers_BxA) -> (rewards_B float32, failed_B int32)."""

    def __init__(self, tokenizer, reward_fn: RewardFn):
        self.tokenizer, self.reward_fn = tokenizer, reward_fn

    def texts(self, tokens_BxT, mask_BxT, answers_BxA) -> tuple[list[str], list[str]]:
        comps = [self.tokenizer.decode(t[m.astype(bool)].tolist(), skip_special_tokens=True)
                 for t, m in zip(np.asarray(tokens_BxT), np.asarray(mask_BxT))]
        golds = [self.tokenizer.decode(a[a != ANSWER_PAD].tolist(), skip_special_tokens=True)
                 for a in np.asarray(answers_BxA)]
        return comps, golds

    def _call(self, comps, golds) -> tuple[np.ndarray, np.ndarray]:
        if hasattr(self.reward_fn, "with_failures"):
            r, codes = self.reward_fn.with_failures(comps, golds)
        else:
            r, codes = self.reward_fn(comps, golds), np.zeros(len(comps), np.int32)
        r = np.asarray(r, dtype=np.float32).reshape(-1)
        if r.shape[0] != len(comps):
            raise ValueError(f"reward function returned {r.shape[0]} values for {len(comps)} completions")
        return r, np.asarray(codes, np.int32).reshape(-1)

    def __call__(self, tokens_BxT, mask_BxT, answers_BxA):
        """(rewards_B, failed_B): failed is 0 where the reward is a verdict, else a `rewards.FAIL_*` code
        (the reward function raised or gave NaN / inf: 1; verifier timeout: 2; gold unparsable: 3; verifier
        error: 4); a failed sample scores 0, is counted in the step's metrics and named in the log."""
        comps, golds = self.texts(tokens_BxT, mask_BxT, answers_BxA)
        B = len(comps)
        failed = np.zeros(B, np.int32)
        try:
            rewards, failed = self._call(comps, golds)
        except Exception as e:  # isolate the failing sample(s) rather than losing the batch
            log.warning("reward function raised on the batch (%s: %s); retrying per sample", type(e).__name__, e)
            rewards = np.zeros(B, np.float32)
            for i in range(B):
                try:
                    r, c = self._call([comps[i]], [golds[i]])
                    rewards[i], failed[i] = r[0], c[0]
                except Exception:
                    failed[i] = FAIL_RAISED
        bad = ~np.isfinite(rewards)
        failed[bad] = FAIL_RAISED
        rewards[bad | (failed > 0)] = 0.0
        if failed.any():
            shown = "; ".join(f"{FAIL_NAMES.get(int(failed[i]), failed[i])}: gold {golds[i][:40]!r}, completion "
                              f"...{comps[i][-60:]!r}" for i in np.flatnonzero(failed)[:3])
            log.warning("reward: %d of %d samples not verified (scored 0): %s", int((failed > 0).sum()), B, shown)
        return rewards.astype(np.float32), failed.astype(np.int32)


def host_rewards(reward_host: HostReward, tokens_BxT, mask_BxT, answers_BxA, mesh=None):
    """Rewards inside jit: one host call per shard of the batch."""
    def cb(t, m, a):
        out = (jax.ShapeDtypeStruct(t.shape[:1], jnp.float32), jax.ShapeDtypeStruct(t.shape[:1], jnp.int32))
        return jax.pure_callback(reward_host, out, t, m, a, vmap_method="sequential")

    if mesh is None or mesh.size == 1:
        return cb(tokens_BxT, mask_BxT, answers_BxA)
    # Rows split over every mesh axis when they divide, so each row is verified once (over the batch
    # axes only, the devices of a tensor-parallel group would each verify the same rows).
    spec = P(shd.MESH_AXES if tokens_BxT.shape[0] % mesh.size == 0 else shd.BATCH_AXES)
    return jax.shard_map(cb, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec),
                         check_vma=False)(tokens_BxT, mask_BxT, answers_BxA)
