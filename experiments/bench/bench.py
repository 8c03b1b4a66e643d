"""RL-step benchmark: this project's fused jitted GRPO/SAGE step against TRL's GRPOTrainer (not a test).

    .venv/bin/python experiments/bench/bench.py            # full run (~20 min on 2 CPU cores)
    .venv/bin/python experiments/bench/bench.py --quick    # tiny shape only, few steps

Both sides get the same random tiny Qwen2 checkpoint (HF format, written once), the same 8 prompts
(16 tokens each, no padding), group size, completion length (forced to the full length: no stop id
on our side, `min_new_tokens` on TRL's), learning rate, AdamW settings, beta > 0 and the same cheap
text reward (`reward.py`). TRL runs in its own pinned virtual environment (`.venv-trl`, created on
first use from `trl_requirements.txt`), in a subprocess, one shape at a time, interleaved with ours.

Outputs next to this file: results.json (docs/design.md §6 schema plus extra keys), results.md, scaling.png.
Dimension key: N prompts, G group size, B = N * G rows, P prompt length, T completion length,
D model, F MLP, L layers, H / K query / kv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # the repo root: studies import each other as experiments.<study>

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from experiments.bench.report import markdown, plot_scaling, varlen_markdown  # noqa: E402
from experiments.bench import step_setup as S, varlen  # noqa: E402
from experiments.bench.step_setup import (BETA, LR, P_LEN, SHAPES, Setup, model_config, prompts, time_fused,  # noqa: E402
                                         write_checkpoint)
from experiments.bench.trl_runner import TRL_VARIANTS, default_trl_variants, ensure_trl_venv, run_trl  # noqa: E402

from sage_jax.rl import guides  # noqa: E402
from sage_jax.rl import losses  # noqa: E402
from sage_jax.rl.advantages import group_advantages  # noqa: E402
from sage_jax.policy.logprobs import grouped_logp_entropy, sequence_logp_entropy  # noqa: E402
from sage_jax.sampling import SamplingConfig, generate, segment_lengths  # noqa: E402


# ------------------------------------------------------------------------------------------ phases
def phase_fns(s: Setup):
    """Separately jitted rollout, reference forward and policy forward+backward+update on the step's shapes."""
    g, cfg, G = s.graphdef, s.cfg, s.G
    P = P_LEN

    # As in rl_step (cfg.share_prompt): each prompt's forward once per group, or the prompt repeated G times.
    def score(model, prompt, pmask, tokens, fmask, cmask):
        if cfg.share_prompt:
            return grouped_logp_entropy(model, prompt, pmask, tokens[:, P:], cmask, cfg.logp_chunk, 1.0)
        return sequence_logp_entropy(model, tokens, fmask, P, cfg.logp_chunk, 1.0)

    @jax.jit
    def rollout(params, prompt, pmask, key):
        rep = lambda x: jnp.repeat(x, G, axis=0)
        model = nnx.merge(g, params)
        out = (generate(model, prompt, pmask, key, cfg.sampling, group_size=G) if cfg.share_prompt else
               generate(model, rep(prompt), rep(pmask), key, cfg.sampling))
        return out.tokens_BxT, out.mask_BxT, out.logp_BxT

    @jax.jit
    def ref_forward(ref_params, prompt, pmask, tokens, fmask, cmask):
        return score(nnx.merge(g, ref_params), prompt, pmask, tokens, fmask, cmask)

    def loss_fn(params, prompt, pmask, tokens, fmask, cmask, adv, ref_logp, ref_ent, step, key):
        logp, ent = score(nnx.merge(g, params), prompt, pmask, tokens, fmask, cmask)
        inputs = guides.GuideInputs(mask_BxT=cmask, step=step, max_steps=cfg.max_steps, key=key, entropy_BxT=ent,
                                    logp_BxT=jax.lax.stop_gradient(logp), ref_logp_BxT=ref_logp,
                                    ref_entropy_BxT=ref_ent)
        log_q, _ = cfg.guide.log_q(inputs)
        loss, _ = losses.policy_loss(logp, None, ref_logp, log_q, adv, cmask, cfg.loss,
                                     num_batch_tokens=cmask.sum())
        return loss

    @jax.jit
    def train(params, opt_state, step, prompt, pmask, tokens, fmask, cmask, adv, ref_logp, ref_ent, key):
        grads = jax.grad(loss_fn)(params, prompt, pmask, tokens, fmask, cmask, adv, ref_logp, ref_ent, step, key)
        upd, opt_state = s.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    return rollout, ref_forward, train


def time_phases(s: Setup, reps: int):
    rollout, ref_forward, train = phase_fns(s)
    st = s.state
    b = s.batch
    key = jax.random.key(1)
    res = {k: [] for k in ("rollout", "reward", "ref_forward", "train")}
    for i in range(reps + 1):  # the first repetition compiles
        t0 = time.perf_counter()
        tokens, cmask, _ = jax.block_until_ready(rollout(st.params, b["prompt"], b["prompt_mask"], key))
        t1 = time.perf_counter()
        tok_np, m_np = np.asarray(tokens), np.asarray(cmask)
        ans = np.repeat(np.asarray(b["answer"]), s.G, axis=0)
        t1b = time.perf_counter()
        rewards, _ = s.host(tok_np, m_np, ans)
        t2 = time.perf_counter()
        prompt = jnp.repeat(b["prompt"], s.G, axis=0)
        full = jnp.concatenate([prompt, tokens], axis=1)
        fmask = jnp.concatenate([jnp.ones_like(prompt), cmask], axis=1)
        adv, _ = group_advantages(jnp.asarray(rewards), s.G, "group")
        jax.block_until_ready((full, fmask, adv))
        t3 = time.perf_counter()
        pr = (b["prompt"], b["prompt_mask"])
        ref_logp, ref_ent = jax.block_until_ready(ref_forward(st.ref_params, *pr, full, fmask, cmask))
        t4 = time.perf_counter()
        out = jax.block_until_ready(train(st.params, st.opt_state, st.step, *pr, full, fmask, cmask, adv,
                                          ref_logp, ref_ent, key))
        t5 = time.perf_counter()
        del out
        if i:
            for k, v in zip(res, (t1 - t0, t2 - t1b, t4 - t3, t5 - t4)):
                res[k].append(v)
    return {k: statistics.median(v) for k, v in res.items()}


# ------------------------------------------------------------------------------------------ roofline
def call_seconds(f, *args, reps=5, pick=min):
    """Seconds of one call of the jitted `f` after a compile call: `pick` (min or a median) of `reps` calls."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return pick(ts)


def matmul_gflops(m, k, n, reps=5, dtype=jnp.float32):
    a = jax.random.normal(jax.random.key(0), (m, k), dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), dtype)
    return 2 * m * k * n / call_seconds(jax.jit(lambda a, b: a @ b), a, b, reps=reps) / 1e9


def flops(mcfg, B, P, T, N=None, segments=1):
    """Matmul FLOPs of each phase as the implementation executes them.

    N: rows that run the prompt positions (the number of prompts under prompt sharing; B without it).
    segments: the sampler's completion cache segments; a decode step in segment i attends over the prompt,
    the finished segments and all of segment i (`sampling.generate`).
    """
    D, F, L, V = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_layers, mcfg.vocab_size
    H, K, Dh = mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim
    body = L * (D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F)  # matmul weights per token
    attn = lambda q, s: 4 * L * H * Dh * q * s  # scores + weighted sum
    S, N = P + T, N or B
    prefill = N * (2 * body * P + attn(P, P) + 2 * D * V)  # the sampler's prompt cache has P slots
    if N == B:  # prompt repeated: one dense S x S pass per row
        fwd = B * (2 * body * S + attn(S, S) + 2 * D * V * T)  # LM head on the T outputs
    else:  # the prompt's P x P pass on N rows; the completion's T x S pass on B rows
        fwd = N * (2 * body * P + attn(P, P)) + B * (2 * body * T + attn(T, S) + 2 * D * V * T)
    # Rollout: the prefill (LM head on the last prompt token), then T - 1 decode steps, segment by segment.
    keys, start = 0, 0
    for length in segment_lengths(T - 1, segments):
        keys += length * (P + start + length)
        start += length
    decode = prefill + (T - 1) * B * (2 * body + 2 * D * V) + B * attn(1, keys)
    return dict(decode=decode, ref_forward=fwd, train=3 * fwd, params_matmul=body + D * V)


# ------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shape only, few steps, no scaling")
    ap.add_argument("--workdir", default="/tmp/sage_bench")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--name", default=None, help="stem of the result files (default results / results_quick)")
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {sorted(SHAPES)} (default tiny,small)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype of our side (parameters stay float32)")
    ap.add_argument("--trl-python", default=None,
                    help="an interpreter that already has TRL (e.g. on an offline GPU machine) instead of .venv-trl")
    ap.add_argument("--trl-variants", default=None, help=f"comma-separated, of {sorted(TRL_VARIANTS)}")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--workloads", default="uniform,varlen",
                    help="uniform: every completion at T (--shapes); varlen: forced heavy-tailed lengths "
                         "(--varlen-shapes; experiments/bench/varlen.py). Without uniform, the results file's "
                         "uniform section is kept as it is")
    ap.add_argument("--varlen-shapes", default=None, help=f"comma-separated, of {sorted(varlen.SHAPES)} "
                                                           "(default tiny,small,long; --quick: tiny)")
    ap.add_argument("--no-phases", action="store_true", help="skip the per-phase breakdown and roofline")
    ap.add_argument("--no-share-prompt", action="store_true",
                    help="repeat each prompt G times in every pass (rl.share_prompt=False)")
    ap.add_argument("--decode-segments", type=int, default=SamplingConfig.decode_segments,
                    help="completion cache segments of the sampler (SamplingConfig.decode_segments)")
    ap.add_argument("--guides", default="none,branch", help="comma-separated guides to time; none is the baseline")
    ap.add_argument("--recount", default=None, metavar="JSON",
                    help="re-derive FLOPs, fractions and speedups of a results file from its measured times "
                         "(after a change to the FLOP count), rewrite it and its .md, and exit")
    a = ap.parse_args()
    if a.recount:
        return recount(a.recount)
    S.DECODE_SEGMENTS = a.decode_segments
    workloads = a.workloads.split(",")
    if not workloads or set(workloads) - {"uniform", "varlen"}:
        ap.error(f"--workloads: of uniform, varlen; got {a.workloads!r}")
    shapes = (a.shapes or ("tiny" if a.quick else "tiny,small")).split(",") if "uniform" in workloads else []
    for sh in shapes:
        if sh not in SHAPES:
            ap.error(f"--shapes: unknown shape {sh!r}; known: {sorted(SHAPES)}")
    varlen_shapes = (a.varlen_shapes or ("tiny" if a.quick else "tiny,small,long")).split(",") \
        if "varlen" in workloads else []
    for sh in varlen_shapes:
        if sh not in varlen.SHAPES:
            ap.error(f"--varlen-shapes: unknown shape {sh!r}; known: {sorted(varlen.SHAPES)}")
    if "none" not in a.guides.split(","):
        ap.error("--guides must include none (the baseline of the speedups)")
    variants = a.trl_variants.split(",") if a.trl_variants else None
    for v in variants or ():
        if v not in TRL_VARIANTS:
            ap.error(f"--trl-variants: unknown variant {v!r}; known: {sorted(TRL_VARIANTS)}")
    accel = jax.default_backend() != "cpu"
    if accel and a.dtype == "float32":
        # torch's float32 matmuls are full precision by default; XLA:GPU's default would be TF32.
        jax.config.update("jax_default_matmul_precision", "highest")
    os.makedirs(a.workdir, exist_ok=True)
    name = a.name or ("results_quick" if a.quick else "results")
    t_start = time.time()
    dev = jax.devices()[0]
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
                cpus=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""), quick=a.quick,
                dtype=a.dtype, share_prompt=not a.no_share_prompt,
                decode_segments=a.decode_segments, started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    path = os.path.join(a.out, f"{name}.json")
    if shapes or not os.path.exists(path):
        res = dict(meta=meta)
    else:  # --workloads varlen: the uniform section stays as its own run wrote it
        res = json.load(open(path))
    if varlen_shapes:
        res["varlen_meta"] = dict(meta, settings=varlen.SETTINGS, minibatches=varlen.MINIBATCHES)
        res["varlen"] = {}

    # Roofline: the machine's matmul throughput in the compute dtype, measured now (the machine is shared).
    mm_dtype = jnp.dtype(a.dtype)
    big = 8192 if accel else 2048
    roof = {f"square_{big}": matmul_gflops(big, big, big, dtype=mm_dtype)}
    for shape in shapes:
        s = SHAPES[shape]
        rows, D, F = s["prompts"] * s["group"], s["hidden_size"], s["intermediate_size"]
        roof[f"decode_{shape}_{rows}x{D}x{F}"] = matmul_gflops(rows, D, F, reps=20, dtype=mm_dtype)
    roof["decode_64x512x8192"] = matmul_gflops(64, 512, 8192, reps=10, dtype=mm_dtype)
    peak_key = f"square_{big}"
    if shapes:
        res["matmul_gflops"] = roof
        res["meta"]["peak_key"] = peak_key
    if varlen_shapes:
        res["varlen_meta"]["matmul_gflops"] = roof
    print("matmul GFLOP/s:", {k: round(v, 1) for k, v in roof.items()}, flush=True)

    py = None if a.no_trl else (a.trl_python or ensure_trl_venv())
    prompts_file = os.path.join(a.workdir, "prompts.json")
    json.dump(prompts(8), open(prompts_file, "w"))
    # Steps after warm-up: the small shape costs tens of seconds per step on a shared 2-core machine.
    counts = dict(tiny=(1, 3) if a.quick else (2, 5), small=(1, 3), medium=(1, 3))

    def save():  # after every shape, so a run cut short keeps what it measured
        res["varlen_meta" if not shapes else "meta"]["wall_s"] = time.time() - t_start
        with open(path + ".tmp", "w") as f:  # whole or not at all: a results file is never left half written
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)
        open(os.path.join(a.out, f"{name}.md"), "w").write(
            markdown(res, [sh for sh in SHAPES if sh in res]) + "\n" + varlen_markdown(res))

    for shape in shapes:
        sh = SHAPES[shape]
        ckpt = write_checkpoint(shape, a.workdir)
        T, G, N = sh["T"], sh["group"], sh["prompts"]
        r = res[shape] = dict(rows=N * G, completion_len=T, prompt_len=P_LEN)
        warmup, steps = counts[shape]
        for guide in a.guides.split(","):
            s = Setup(ckpt, T, G, guide, N, a.dtype, not a.no_share_prompt)
            r[f"ours_{guide}"] = time_fused(s, warmup, steps)
            print(shape, guide, {k: v for k, v in r[f"ours_{guide}"].items() if k != "step_s"}, flush=True)
            if guide == "none" and not a.no_phases:
                r["phases_s"] = time_phases(s, reps=2)
                print(shape, "phases", r["phases_s"], flush=True)
            del s
        summarise(r, shape, N, G, T, roof, peak_key, not a.no_share_prompt, a.decode_segments)
        save()  # ours, before TRL: a TRL run cut short by the caller's timeout must not take our numbers along
        if py:
            tw, ts = (1, 3) if a.quick or accel else (2, 4) if shape == "tiny" else (1, 2)
            for variant in variants or default_trl_variants(shape, a.dtype, accel):
                r[f"trl_{variant}"] = run_trl(py, ckpt, prompts_file, T, G, tw + ts, tw,
                                              os.path.join(a.workdir, f"trl_{shape}_{variant}.json"), variant,
                                              "cuda" if accel else "cpu", LR, BETA,
                                              timeout_s=180 if shape == "tiny" or accel else 300)
                print(shape, "trl", variant, r[f"trl_{variant}"]["median_step_s"], flush=True)
            if not accel:  # ours once more after TRL: this CPU is shared, so bracket TRL's run with ours
                s = Setup(ckpt, T, G, "none", N, a.dtype, not a.no_share_prompt)
                r["ours_none_after"] = time_fused(s, warmup, steps if shape == "tiny" else 2)
                del s
        summarise(r, shape, N, G, T, roof, peak_key, not a.no_share_prompt, a.decode_segments)
        save()

    for shape in varlen_shapes:
        res["varlen"][shape] = varlen.measure(shape, a, py, variants, accel)
        save()
        print(varlen_markdown(res), flush=True)
        if name == "results" and os.path.abspath(a.out) == HERE:  # the committed file: the README quotes it
            from experiments.readme_blocks import write_block
            write_block(os.path.join(ROOT, "README.md"), "bench_varlen", varlen_markdown(res))

    if shapes and not (a.quick or a.no_scaling):
        ckpt = write_checkpoint("tiny", a.workdir)
        scal = dict(completion_len={}, group_size={})
        for T in (64, 128, 256, 512):
            s = Setup(ckpt, T, 8, "none", 8, a.dtype, not a.no_share_prompt)
            scal["completion_len"][T] = time_fused(s, 1, 2)["median_step_s"]
            print("scaling T", T, scal["completion_len"][T], flush=True)
        for G in (4, 8, 16, 32):
            s = Setup(ckpt, 64, G, "none", 8, a.dtype, not a.no_share_prompt)
            scal["group_size"][G] = time_fused(s, 1, 2)["median_step_s"]
            print("scaling G", G, scal["group_size"][G], flush=True)
        res["scaling_tiny"] = scal
        plot_scaling(scal, os.path.join(a.out, "scaling.png"))
    save()
    print(markdown(res, [sh for sh in SHAPES if sh in res]) + "\n" + varlen_markdown(res))


def recount(path):
    res = json.load(open(path))
    meta = res["meta"]
    if "decode_segments" not in meta:
        sys.exit(f"{path}: meta.decode_segments missing (a run before the segmented sampler); not recounted")
    shapes = [sh for sh in SHAPES if sh in res]
    for shape in shapes:
        r, sh = res[shape], SHAPES[shape]
        summarise(r, shape, sh["prompts"], sh["group"], r["completion_len"], res["matmul_gflops"],
                  meta["peak_key"], meta["share_prompt"], meta["decode_segments"])
    meta["recounted"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    json.dump(res, open(path, "w"), indent=1)
    open(path[:-len(".json")] + ".md", "w").write(markdown(res, shapes))
    print(markdown(res, shapes))


def summarise(r, shape, N, G, T, roof, peak_key, share_prompt, segments):
    """Adds the FLOPs, each phase's achieved throughput and fraction of peak, and the speedups to `r`."""
    mcfg = model_config(shape)
    fl = flops(mcfg, N * G, P_LEN, T, N if share_prompt else None, segments)
    ph = r.get("phases_s")
    peak = roof[peak_key]
    rate = lambda k, phase: fl[k] / ph[phase] / 1e9
    r["flops"] = fl
    r["roofline"] = ph and {
        "decode": dict(gflops=rate("decode", "rollout"), frac_of_square=rate("decode", "rollout") / peak,
                       frac_of_decode_shaped=rate("decode", "rollout") /
                       roof[f"decode_{shape}_{N * G}x{mcfg.hidden_size}x{mcfg.intermediate_size}"]),
        "ref_forward": dict(gflops=rate("ref_forward", "ref_forward"),
                            frac_of_square=rate("ref_forward", "ref_forward") / peak),
        "train": dict(gflops=rate("train", "train"), frac_of_square=rate("train", "train") / peak),
    }
    ours = statistics.median([r["ours_none"]["median_step_s"]] +
                             ([r["ours_none_after"]["median_step_s"]] if "ours_none_after" in r else []))
    r["ours_step_s"] = ours
    r["ours_tokens_per_s"] = N * G * T / ours
    trl = {v: r[f"trl_{v}"]["median_step_s"] for v in TRL_VARIANTS
           if f"trl_{v}" in r and r[f"trl_{v}"]["median_step_s"] == r[f"trl_{v}"]["median_step_s"]}  # not NaN
    if trl:
        r["trl_best_variant"] = min(trl, key=trl.get)
        r["trl_step_s"] = trl[r["trl_best_variant"]]
        r["speedup"] = r["trl_step_s"] / ours
        r["trl_tokens_per_s"] = N * G * T / r["trl_step_s"]
        if "defaults" in trl:
            r["trl_defaults_step_s"] = trl["defaults"]
            r["speedup_vs_trl_defaults"] = trl["defaults"] / ours
    if "ours_branch" in r:
        r["branch_over_none"] = r["ours_branch"]["median_step_s"] / r["ours_none"]["median_step_s"]
    # The step's ceiling on this machine: every FLOP at the square 2048^3 matmul's measured rate; and the
    # shape-aware one, where the decode's skinny B x D matmuls run at their own measured rate (the fastest
    # this machine does that shape), the dense passes at the square rate.
    decode_rate = roof[f"decode_{shape}_{N * G}x{mcfg.hidden_size}x{mcfg.intermediate_size}"]
    dense = fl["ref_forward"] + fl["train"]
    ceil = {"step_s": (fl["decode"] + dense) / peak / 1e9,
            "shape_aware_step_s": (fl["decode"] / decode_rate + dense / peak) / 1e9}
    ceil.update(frac=ceil["step_s"] / ours, shape_aware_frac=ceil["shape_aware_step_s"] / ours)
    if "trl_step_s" in r:
        ceil.update(speedup=r["trl_step_s"] / ceil["step_s"], shape_aware_speedup=r["trl_step_s"] / ceil["shape_aware_step_s"])
    r["ceiling"] = ceil


if __name__ == "__main__":
    main()
