"""The training side of an RL step on a variable-length workload: padded (rl.length_buckets = 1) against bucketed.

    .venv/bin/python experiments/varlen/run.py            # tiny, small, long; writes results.{json,md}, README
    .venv/bin/python experiments/varlen/run.py --quick    # tiny only, fewer repetitions (does not write)

What it times: the no-gradient passes (reference, `old`) and the update scan (policy forward and backward, AdamW)
of `sage_jax.rl.step`, jitted together, on a rollout whose completion lengths are drawn from the stated
distribution: log-normal with mean 0.3 T (sigma 1 in log space), 10% of the rows at the cap T, prompts of varied
length (left-padded to P). Decode is not in it: the sampler still runs to the longest row of a segment
(issue 38's items 1 and 3, open). A/B in one process, alternating, the median of `--reps` calls each.

Useful fraction, per phase: real completion tokens over completion positions executed, from the chunking each
phase uses (rows sorted by length into score_chunks x K chunks for the reference and `old` passes, J x K chunks per
minibatch for the policy pass; each chunk at the smallest of K lengths ceil(kT/K) that holds it). Positions, not
FLOPs: the attention's share grows with length and is not weighted here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)  # the repo root: studies import each other as experiments.<study>

SHAPES = {  # the bench's model shapes (experiments/bench/bench.py), and one long completion budget
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, N=8, G=8, P=32, T=64),
    "small": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, N=8, G=8, P=32, T=128),
    "long": dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, N=2, G=8, P=64, T=1024),
}
MEAN_FRACTION, CAPPED, SIGMA = 0.3, 0.10, 1.0
BUCKETS = (1, 4, 8)


def lengths(rng, B: int, T: int) -> np.ndarray:
    """Completion lengths: 10% of the rows at T, the rest log-normal with mean 0.3 T (clipped to [1, T])."""
    mu = np.log(MEAN_FRACTION * T) - SIGMA ** 2 / 2
    out = np.clip(np.round(rng.lognormal(mu, SIGMA, size=B)), 1, T).astype(np.int64)
    out[rng.permutation(B)[: int(round(CAPPED * B))]] = T
    return out


def useful_fractions(L: np.ndarray, T: int, K: int, score_chunks: int, M: int, J: int) -> dict:
    """Real completion tokens / completion positions executed, per phase, for the chunking the step uses."""
    from sage_jax.policy.logprobs import length_grid
    grid = np.asarray(length_grid(T, K))
    at = lambda chunk: grid[np.searchsorted(grid, chunk.max())] * len(chunk)
    order = np.sort(L)[::-1]
    C = score_chunks * K
    scored = sum(at(order[c * len(L) // C:(c + 1) * len(L) // C]) for c in range(C))  # chunk c: ranks in order
    per_mb = len(L) // M
    policy = 0
    for m in range(M):  # a minibatch's rows (batch order here: rl.update_shuffle none), sorted, in J x K chunks
        mb = np.sort(L[m * per_mb:(m + 1) * per_mb])[::-1]
        n = J * K
        policy += sum(at(mb[c * per_mb // n:(c + 1) * per_mb // n]) for c in range(n))
    real = L.sum()
    return {"reference": real / scored, "old": real / scored, "policy": real / policy}


def build(shape: str, K: int, seed: int = 0):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sage_jax.models.decoder import Decoder
    from sage_jax.models.tiny import tiny_config
    from sage_jax.policy import optim, state as train_state
    from sage_jax.policy.state import merge_policy
    from sage_jax.rl import losses, step as R
    from sage_jax.rl.rollout import Rollout
    from sage_jax.rl.update import reduce_metrics, update_scan
    from sage_jax.sampling import SamplingConfig

    s = SHAPES[shape]
    N, G, P, T = s["N"], s["G"], s["P"], s["T"]
    mcfg = tiny_config(hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                       num_kv_heads=2, intermediate_size=s["intermediate_size"])
    cfg = R.RLConfig(group_size=G, sampling=SamplingConfig(max_new_tokens=T, eos_ids=(), pad_id=0),
                     loss=losses.LossConfig(beta=0.04), guide="branch", num_minibatches=2, length_buckets=K)
    tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-6, weight_decay=0.0, grad_clip_norm=1.0))
    graphdef, state = train_state.init_train_state(Decoder(mcfg, rngs=nnx.Rngs(seed)), cfg, tx, seed)
    rng = np.random.default_rng(seed)
    B = N * G
    L = lengths(rng, B, T)
    plen = rng.integers(P // 4, P + 1, size=N)
    pmask = (np.arange(P)[None, :] >= (P - plen)[:, None]).astype(np.int32)
    cmask = (np.arange(T)[None, :] < L[:, None]).astype(np.int32)
    V = mcfg.vocab_size
    ro = Rollout(jnp.asarray(rng.integers(3, V, size=(N, P)) * pmask, jnp.int32), jnp.asarray(pmask),
                 jnp.asarray(rng.integers(3, V, size=(B, T)) * cmask, jnp.int32), jnp.asarray(cmask),
                 jnp.asarray(cmask), jnp.asarray(-rng.uniform(0.1, 3, size=(B, T)) * cmask, jnp.float32),
                 jnp.asarray(rng.normal(size=B), jnp.float32), {})
    merge = lambda p: merge_policy(graphdef, p, state.frozen_params)

    @jax.jit
    def train_side(state, ro):
        scores = R.no_gradient_passes(state, ro, merge, cfg)
        (params, _, _), ms = update_scan(state, ro, scores, merge, cfg, tx, lr_fn, jax.random.PRNGKey(1))
        return params, reduce_metrics(ms)

    return train_side, state, ro, L, cfg


def measure(shape: str, reps: int) -> dict:
    import jax
    s = SHAPES[shape]
    runs = {K: build(shape, K) for K in BUCKETS}
    for K, (f, st, ro, _, _) in runs.items():  # compile and warm up
        jax.block_until_ready(f(st, ro))
    times = {K: [] for K in BUCKETS}
    for _ in range(reps):  # alternating, so drift of the shared machine hits every variant alike
        for K, (f, st, ro, _, _) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(st, ro))
            times[K].append(time.perf_counter() - t0)
    losses = {K: float(jax.device_get(f(st, ro)[1]["train/loss"])) for K, (f, st, ro, _, _) in runs.items()}
    L = runs[1][3]
    out = {"shape": shape, **{k: s[k] for k in ("N", "G", "P", "T")}, "mean_length": float(L.mean()),
           "capped_rows": int((L == s["T"]).sum()), "reps": reps, "step_s": {}, "useful_fraction": {}, "loss": {}}
    for K in BUCKETS:
        cfg = runs[K][4]
        out["step_s"][str(K)] = float(np.median(times[K]))
        out["useful_fraction"][str(K)] = useful_fractions(L, s["T"], K, cfg.score_chunks, cfg.num_minibatches,
                                                          cfg.grad_accum_steps)
        out["loss"][str(K)] = losses[K]
    out["speedup"] = {str(K): out["step_s"]["1"] / out["step_s"][str(K)] for K in BUCKETS}
    return out


def render(results: dict) -> str:
    L = ["| shape | N x G, P + T | mean length (capped rows) | K | train-side step s | vs padded | useful: reference / old / policy | loss |",
         "|---|---|---|---|---|---|---|---|"]
    for r in results["shapes"]:
        for K in BUCKETS:
            u = r["useful_fraction"][str(K)]
            L.append(f"| {r['shape']} | {r['N']} x {r['G']}, {r['P']} + {r['T']} | {r['mean_length']:.1f} "
                     f"({r['capped_rows']}) | {K} | {r['step_s'][str(K)]:.3f} | {r['speedup'][str(K)]:.2f}x | "
                     f"{u['reference']:.2f} / {u['old']:.2f} / {u['policy']:.2f} | {r['loss'][str(K)]:.6f} |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 3 repetitions; prints, writes nothing")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    shapes = (a.shapes or ("tiny" if a.quick else "tiny,small,long")).split(",")
    results = {"workload": f"log-normal completion lengths, mean {MEAN_FRACTION} T (sigma {SIGMA}), "
                           f"{CAPPED:.0%} of rows at T; prompt lengths uniform in [P/4, P], left-padded",
               "device": __import__("jax").devices()[0].device_kind, "shapes": []}
    for sh in shapes:
        results["shapes"].append(measure(sh, 3 if a.quick else a.reps))
        print(render(results), flush=True)
        if not a.quick:  # after every shape, so a run cut short keeps what it measured
            from experiments.readme_blocks import write_block
            json.dump(results, open(os.path.join(HERE, "results.json"), "w"), indent=1)
            open(os.path.join(HERE, "results.md"), "w").write(render(results))
            write_block(os.path.join(REPO, "README.md"), "varlen", render(results))


if __name__ == "__main__":
    main()
