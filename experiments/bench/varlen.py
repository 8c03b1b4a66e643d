"""The bench's variable-length workload (issue 38): the whole RL step, ours bucketed, ours padded and TRL's
GRPOTrainer, on completions whose lengths are forced identically on both sides.

The workload is experiments/varlen's (one definition, imported): completion lengths log-normal with mean 0.3 T
(sigma 1 in log space), 10% of the rows at the cap T; prompts of lengths uniform in [P/4, P] (one at P, so both
sides pad the batch to P). Row b (prompt b // G, as TRL's unshuffled RepeatSampler orders them) ends after
lengths[b] tokens:
- ours: `ForcedLengths`, a `SamplingConfig.stop` rule (the interface stop strings use) that ends the row after
  its count of tokens; no stop id, so a sampled EOS does not end a row early. The step is otherwise unchanged.
- TRL: a logits processor added to `generate` (trl_side.py) that masks EOS before the row's last token and forces
  it there (TRL's completion mask keeps the EOS, so the row has lengths[b] tokens too).
Both sides check the lengths they saw: ours the rollout's token count, TRL its logged mean / min / max.

Useful fraction, per phase: FLOPs on real tokens over FLOPs executed, counted from the model's shape for the
chunks each phase runs (`useful_fractions`). Real: each prompt's real tokens once (prompt sharing), each row's
real completion tokens, and causal attention over real keys only; executed: what the implementation computes,
padding and masked attention scores included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from experiments.bench import step_setup as S  # noqa: E402
from experiments.bench.trl_runner import TRL_VARIANTS, default_trl_variants, run_trl  # noqa: E402
from experiments.varlen.run import CAPPED, MEAN_FRACTION, SHAPES, SIGMA, lengths as completion_lengths  # noqa: E402

# Our step's real-token settings timed on this workload ("ours" is the faster in the run, as TRL's is its fastest
# configuration); "padded" is the step without one, every pass over the [B, P + T] rectangle.
SETTINGS = {"padded": {}, "buckets": {"length_buckets": 8}, "pack": {"pack_buckets": 4}}
MINIBATCHES = 2  # updates per rollout, so the step runs an `old` pass (TRL: steps_per_generation = 2)
PROMPT_CHARS = "0123456789+-*=()"
MAX_POSITIONS = 2048  # the long shape's P + T = 1088 is beyond tiny_config's 1024
WORKLOAD = (f"completion lengths log-normal with mean {MEAN_FRACTION} T (sigma {SIGMA}), {CAPPED:.0%} of rows at "
            "T, forced on both sides; prompt lengths uniform in [P/4, P] (one at P), left-padded to P")


def workload(shape: str, seed: int = 0) -> dict:
    """The shape's prompts (text, one token per character) and each row's forced completion length."""
    s = SHAPES[shape]
    N, G, P, T = s["N"], s["G"], s["P"], s["T"]
    rng = np.random.default_rng(seed)
    L = completion_lengths(rng, N * G, T)
    plen = rng.integers(P // 4, P + 1, size=N)
    plen[0] = P  # the batch's padded width is P on both sides
    prompts = ["".join(rng.choice(list(PROMPT_CHARS), size=n)) for n in plen]
    return dict(N=N, G=G, P=P, T=T, prompts=prompts, prompt_lengths=[int(n) for n in plen],
                lengths=[int(x) for x in L])


def model_config(shape: str):
    from sage_jax.models.tiny import tiny_config
    s = SHAPES[shape]
    cfg = tiny_config(hidden_size=s["hidden_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                      num_kv_heads=2, intermediate_size=s["intermediate_size"])
    return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, MAX_POSITIONS))


class ForcedLengths:
    """A benchmark-only `SamplingConfig.stop` rule: row b ends after its lengths[b]-th token (which is kept, as
    an EOS is). Hashable, so it sits in the static sampling config; the lengths are the step's constants."""

    def __init__(self, lengths):
        self.lengths = tuple(int(n) for n in lengths)
        if min(self.lengths) < 1:
            raise ValueError(f"forced lengths must be >= 1, got {min(self.lengths)}")

    def __hash__(self):
        return hash(("ForcedLengths", self.lengths))

    def __eq__(self, other):
        return isinstance(other, ForcedLengths) and other.lengths == self.lengths

    def start(self, rows: int):
        import jax.numpy as jnp
        if rows != len(self.lengths):
            raise ValueError(f"ForcedLengths holds {len(self.lengths)} rows, the sampler runs {rows}")
        return jnp.zeros((rows, 1), jnp.int32)

    def advance(self, count_Bx1, tok_B):
        import jax.numpy as jnp
        count = count_Bx1 + 1
        return count, count[:, 0] >= jnp.asarray(self.lengths, jnp.int32)


# ------------------------------------------------------------------------------------------ FLOP accounting
def _grid(n: int, K: int) -> list[int]:
    """The K static sizes a pass picks from: ceil(k n / K), k = 1..K (rl.length_buckets, rl.pack_buckets)."""
    return sorted({-(-n * k // K) for k in range(1, K + 1)})


def packed_rows(L, prompt_of, T: int) -> int:
    """Rows of T slots that hold the completions, each row one prompt's: first fit decreasing per prompt."""
    rows = 0
    for q in np.unique(prompt_of):
        fills = []
        for n in sorted(L[prompt_of == q], reverse=True):
            k = next((i for i, f in enumerate(fills) if f + n <= T), None)
            if k is None:
                fills.append(n)
            else:
                fills[k] += n
        rows += len(fills)
    return rows


def useful_fractions(mcfg, w: dict, real: dict, segments: int, minibatches: int = MINIBATCHES) -> dict:
    """Per phase (decode, reference, old, policy): FLOPs executed, FLOPs on real tokens and their ratio, for the
    varlen step (shared prompts, score_chunks 1, `minibatches` updates per rollout of whole groups, no
    accumulation) under `real`: {} (the padded step), {"length_buckets": K} or {"pack_buckets": K}.

    Executed, as the step runs it (rl/step.py, rl/update.py, policy/packing.py, sampling.py):
    - decode: the prefill of N prompts at P; then every decode step t = 1 .. max(L) - 1 (a segment's loop ends
      when every row is done) runs all B rows, each attending over P + the finished segments + its whole segment.
    - reference and old, over all B rows; policy, over each minibatch (B / M consecutive rows), forward + backward
      = 3 x forward:
      - padded: the rows' prompts once each (P x P) and every row's T completion slots over P + T keys.
      - length buckets K: the rows sorted by length into K chunks, each at the smallest of ceil(k T / K) that holds
        its longest row; a chunk runs every prompt once when it has more rows than there are prompts (the policy:
        no fewer), else each row with its own prompt (P + t positions).
      - packing K: the pass's prompts once each, and R rows of T slots over P + T keys, R the smallest of
        ceil(k rows / K) that holds the completions packed first fit decreasing per prompt (`packed_rows`).
    Real: each prompt's p real tokens once per pass (per minibatch for the policy), causal among them; each row's
    L real tokens, token j over p + j keys; the LM head on real completion tokens (decode: once per sampled
    token)."""
    D, F, Lyr, V = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_layers, mcfg.vocab_size
    H, Kv, Dh = mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim
    body = 2 * Lyr * (D * H * Dh + 2 * D * Kv * Dh + H * Dh * D + 3 * D * F)  # per token: projections + MLP
    attn = 4 * Lyr * H * Dh  # per query-key pair: scores + weighted sum
    head = 2 * D * V
    N, G, P, T = w["N"], w["G"], w["P"], w["T"]
    B, M = N * G, minibatches
    L = np.asarray(w["lengths"], np.float64)
    p = np.asarray(w["prompt_lengths"], np.float64)
    p_row = np.repeat(p, G)
    causal = lambda n: n * (n + 1) / 2  # query-key pairs of n tokens attending causally among themselves

    seg = [(T - 1) // segments + (i < (T - 1) % segments) for i in range(min(segments, T - 1))]
    ends = np.cumsum(seg)  # completion slots filled by the end of segment i
    written = np.arange(1, int(L.max())) - 1  # decode step t writes slot t - 1 and samples token t
    keys = P + ends[np.searchsorted(ends, written, side="right")]
    decode = (N * (body * P + attn * P * P + head) + B * (len(written) * (body + head) + attn * keys.sum()),
              body * p.sum() + attn * causal(p).sum() + head * N
              + ((L - 1) * (body + head)).sum() + attn * ((L - 1) * p_row + causal(L - 1)).sum())

    def real_fwd(rows):  # the rows' real tokens, their prompts once each
        prompts = p[np.unique(rows // G)]
        return (body * prompts.sum() + attn * causal(prompts).sum()
                + (L[rows] * (body + head)).sum() + attn * (L[rows] * p_row[rows] + causal(L[rows])).sum())

    prompt_pass = lambda n: n * (body * P + attn * P * P)  # n prompts at P, once each
    completions = lambda r, t: r * ((body + head) * t + attn * t * (P + t))  # r rows of t slots behind a prompt

    def executed_fwd(rows, shares):  # shares(r): a bucket chunk of r rows runs every prompt once
        n_prompts = len(np.unique(rows // G))
        if "pack_buckets" in real:
            grid = np.asarray(_grid(len(rows), real["pack_buckets"]))
            R = int(grid[np.searchsorted(grid, packed_rows(L[rows], rows // G, T))])
            return prompt_pass(n_prompts) + completions(R, T)
        K = real.get("length_buckets", 1)
        if K == 1:
            return prompt_pass(n_prompts) + completions(len(rows), T)
        grid = np.asarray(_grid(T, K))
        rows = rows[np.argsort(-L[rows], kind="stable")]
        total = 0.0
        for c in range(K):  # chunk c: the c-th K-th of the rows by length, the longest first
            chunk = rows[c * len(rows) // K:(c + 1) * len(rows) // K]
            t, r = int(grid[np.searchsorted(grid, L[chunk].max())]), len(chunk)
            total += prompt_pass(N) + completions(r, t) if shares(r) else r * (body * (P + t) + head * t + attn * (P + t) ** 2)
        return total

    every = np.arange(B)
    scores = (executed_fwd(every, lambda r: N < r), real_fwd(every))
    minibatch = [np.arange(m * B // M, (m + 1) * B // M) for m in range(M)]
    policy = (3 * sum(executed_fwd(mb, lambda r: N <= r) for mb in minibatch), 3 * sum(real_fwd(mb) for mb in minibatch))
    out = {"decode": decode, "reference": scores, "old": scores, "policy": policy}
    return {k: dict(executed_flops=float(e), real_flops=float(r), fraction=float(r / e)) for k, (e, r) in out.items()}


# ------------------------------------------------------------------------------------------ the run
def measure(shape, a, py, variants, accel) -> dict:
    """The variable-length workload at `shape` (experiments/bench/py): our step under each of
    SETTINGS (padded, length buckets, packing) alternating, before and after TRL's configurations on the
    same forced lengths; "ours" is the faster real-token setting; the useful fraction of each phase."""
    w = workload(shape)
    N, G, P, T = w["N"], w["G"], w["P"], w["T"]
    mcfg = model_config(shape)
    ckpt = S.save_random(mcfg, os.path.join(a.workdir, f"ckpt_varlen_{shape}"))
    stop = ForcedLengths(w["lengths"])
    M = MINIBATCHES
    sides = {name: S.Setup(ckpt, T, G, "none", N, a.dtype, texts=w["prompts"], stop=stop, minibatches=M, **real)
             for name, real in SETTINGS.items()}
    L = np.asarray(w["lengths"])
    r = dict(workload=WORKLOAD, rows=N * G, N=N, G=G, P=P, T=T, minibatches=M, settings=SETTINGS,
             mean_length=float(L.mean()), capped_rows=int((L == T).sum()),
             mean_prompt_length=float(np.mean(w["prompt_lengths"])), lengths=w["lengths"],
             prompt_lengths=w["prompt_lengths"])
    r["first_step_s"] = {k: S.timed_step(s) for k, s in sides.items()}  # compiles
    times, compiles_before = {k: [] for k in sides}, S._COMPILES[0]
    reps = 3 if shape == "tiny" else 2

    def alternate():  # A/B alternating, so drift of the shared machine hits every setting alike
        for _ in range(reps):
            for k, s in sides.items():
                times[k].append(S.timed_step(s))
                print(f"varlen {shape} {k} {times[k][-1]:.3f} s", flush=True)

    alternate()
    if py:
        wd = a.workdir
        pf, lf = os.path.join(wd, f"varlen_{shape}_prompts.json"), os.path.join(wd, f"varlen_{shape}_lengths.json")
        json.dump(w["prompts"], open(pf, "w"))
        json.dump(w["lengths"], open(lf, "w"))
        tw, ts = (1, 3) if accel else (2, 3) if shape == "tiny" else (1, 2)
        for variant in variants or default_trl_variants(shape, a.dtype, accel):
            t = r[f"trl_{variant}"] = run_trl(py, ckpt, pf, T, G, tw + ts, tw, os.path.join(wd, f"trl_varlen_{shape}_"
                                              f"{variant}.json"), variant, "cuda" if accel else "cpu", S.LR, S.BETA,
                                              timeout_s=900, lengths_file=lf, steps_per_generation=M)
            seen = t.get("completion_lengths") or []  # (min, max, mean) per logged update
            t["lengths_match"] = bool(seen) and all(abs(mn - L.min()) < 1e-6 and abs(mx - L.max()) < 1e-6 and
                                                    abs(mean - L.mean()) < 1e-3 for mn, mx, mean in seen)
            if not t["lengths_match"]:
                print(f"TRL {variant} at {shape}: completion lengths {seen[:2]} are not the forced ones "
                      f"(min {L.min()}, max {L.max()}, mean {L.mean():.3f}): not comparable", flush=True)
            print(f"varlen {shape} trl {variant} {t['median_step_s']:.3f} s", flush=True)
        if not accel:
            alternate()  # ours once more after TRL: this CPU is shared, so bracket TRL's run with ours
    r["compiles_after_first_step"] = S._COMPILES[0] - compiles_before
    r["step_s"] = times
    medians = {k: statistics.median(v) for k, v in times.items()}
    r["ours_setting"] = min((k for k in medians if k != "padded"), key=medians.get)
    r["ours_step_s"], r["padded_step_s"] = medians[r["ours_setting"]], medians["padded"]
    r["setting_step_s"] = medians
    r["speedup_vs_padded"] = r["padded_step_s"] / r["ours_step_s"]
    trl = {v: r[f"trl_{v}"]["median_step_s"] for v in TRL_VARIANTS if f"trl_{v}" in r and
           r[f"trl_{v}"]["lengths_match"] and r[f"trl_{v}"]["median_step_s"] == r[f"trl_{v}"]["median_step_s"]}
    if trl:
        r["trl_best_variant"] = min(trl, key=trl.get)
        r["trl_step_s"] = trl[r["trl_best_variant"]]
        r["speedup_vs_trl"] = r["trl_step_s"] / r["ours_step_s"]
    r["flops"] = {k: useful_fractions(mcfg, w, real, S.DECODE_SEGMENTS, M) for k, real in SETTINGS.items()}
    fractions = {k: {ph: v["fraction"] for ph, v in f.items()} for k, f in r["flops"].items()}
    r["useful_fraction"], r["padded_useful_fraction"] = fractions[r["ours_setting"]], fractions["padded"]
    r["setting_useful_fraction"] = fractions
    return r
