"""Worker for tests/test_multihost.py: one process of a 2-process (or 1-process reference) job.

`python tests/multihost_worker.py --num-processes N --process-id I --port P --out FILE` with
XLA_FLAGS giving this process its fake CPU devices (2 each for N=2, 4 for the reference). All
processes together form one 4-device mesh (data=1, fsdp=2, tensor=2); each loads only its own
prompts, runs 2 RL steps of the tiny setup through `make_rl_step(..., mesh)`, and writes the
metrics, a param checksum and how many rows its reward callback verified.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from sage_jax import distributed  # noqa: E402  (no JAX backend touched before initialize)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.num_processes > 1:
        assert distributed.maybe_initialize(f"127.0.0.1:{a.port}", a.num_processes, a.process_id)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import rl_fixtures as F
    from sharding_worker import make_model, parts

    from sage_jax import sharding as shd
    from sage_jax.rewards.host import HostReward
    from sage_jax.policy import state as train_state
    from sage_jax.rl import step as R

    assert jax.device_count() == 4 and jax.process_count() == a.num_processes
    mesh = shd.make_mesh((1, 2, 2))
    cfg, tx, lr_fn = parts()
    graphdef, state = train_state.init_train_state_sharded(make_model, cfg, tx, 0, mesh)

    verified = []

    def reward(completions, answers):
        verified.append(len(completions))
        return F.count_ones(completions, answers)

    full = {k: np.asarray(v) for k, v in F.batch().items()}  # stands in for this host's data loader
    n = full["prompt"].shape[0]
    share = n // jax.process_count()  # this host's rows: its process-contiguous share, as the data pipeline gives
    lo, hi = jax.process_index() * share, (jax.process_index() + 1) * share
    batch = distributed.global_batch({k: v[lo:hi] for k, v in full.items()}, mesh)
    step = R.make_rl_step(graphdef, cfg, tx, lr_fn, HostReward(F.TOK, reward), mesh=mesh)
    sq = jax.jit(lambda p: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(p)),
                 out_shardings=shd.replicated(mesh))
    metrics = []
    for _ in range(2):
        state, m = step(state, batch)
        metrics.append({k: float(v) for k, v in m.items()})  # replicated: every host can read them
    rec = {"process": jax.process_index(), "rows": [lo, hi], "metrics": metrics,
           "param_sq": float(sq(state.params)), "verified_rows": sum(verified),
           "cache_size": step._cache_size()}
    with open(a.out, "w") as f:
        json.dump(rec, f)
    if a.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
