"""Where the training phase's time goes (not a test): policy forward + backward + AdamW, profiled per op.

    .venv/bin/python experiments/bench/profile_train.py [--shapes tiny,small] [--workdir /tmp/sage_bench]

The training phase of `bench.py` (`phase_fns`: the same program the fused step runs for its update) is
traced once with `jax.profiler` after a warm-up. Each XLA:CPU thunk's time is mapped to its HLO
instruction in the compiled module and put in one of these classes:

- `dot (matmul)`: thunks that run a `dot` without batch dimensions, alone or fused with its neighbours (the
  projections, MLP, unembedding and their weight / input gradients); their FLOPs are counted from the
  shapes, so their rate is measured;
- `dot (batched)`: thunks that run a `dot` with batch dimensions (attention scores and weighted sums);
- `fusion`: XLA's fused elementwise / reduction kernels without a dot (softmax, silu, RMSNorm, the loss,
  AdamW), named by the jax op their metadata ends in;
- `copy / transpose`: layout changes XLA:CPU inserts between them;
- `other`: everything else (scatter, gather, while-loop bookkeeping, ...).

Thunks run on 2 threads, so their sum can exceed the wall time. Writes `profile_train.json` beside this
file and the README's `profile_train` block from it. Run it on an idle machine (the shares move under load).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root: studies import each other as experiments.<study>

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.bench import bench  # noqa: E402
from experiments.bench.profile_decode import thunk_times  # noqa: E402
from sage_jax.rl.advantages import group_advantages  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\w[\w-]*)\(([^)]*)\)(.*)$", re.M)


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def instructions(hlo: str) -> dict:
    """name -> (result shape, opcode, operand text, rest of the line) for every instruction of the module."""
    return {m.group(1): (m.group(2), m.group(3), m.group(4), m.group(5)) for m in _INSTR.finditer(hlo)}


def dot_flops(instr: dict, name: str) -> tuple[float, bool]:
    """(2 x output elements x contracted size, has batch dims) of a `dot` instruction."""
    shape, _, operands, rest = instr[name]
    lhs = re.findall(r"%(\S+)", operands)[0].rstrip(",")
    lhs_dims = _dims(instr[lhs][0]) if lhs in instr else _dims(operands)
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    batch = re.search(r"lhs_batch_dims=\{([\d,]*)\}", rest)
    k = 1
    for d in (contract.group(1).split(",") if contract and contract.group(1) else []):
        k *= lhs_dims[int(d)]
    out = int(np.prod(_dims(shape))) if _dims(shape) else 1
    return 2.0 * out * k, bool(batch and batch.group(1))


def dot_dims(instr: dict, name: str) -> tuple:
    """(lhs dims, rhs dims, lhs contracting, rhs contracting, lhs batch, rhs batch) of a `dot` instruction."""
    _, _, operands, rest = instr[name]
    names = [n.rstrip(",") for n in re.findall(r"%(\S+)", operands)]
    dims = tuple(tuple(_dims(instr[n][0])) if n in instr else () for n in names[:2])
    nums = lambda key: tuple(int(x) for x in (re.search(key + r"=\{([\d,]*)\}", rest) or [None, ""])[1].split(",") if x)
    return (*dims, nums("lhs_contracting_dims"), nums("rhs_contracting_dims"), nums("lhs_batch_dims"),
            nums("rhs_batch_dims"))


def standalone_gflops(sig: tuple, reps: int = 5) -> float:
    """The rate of one `dot_general` of this signature alone, on fresh contiguous float32 operands."""
    lhs, rhs, lc, rc, lb, rb = sig
    a = jax.random.normal(jax.random.key(0), lhs, jnp.float32)
    b = jax.random.normal(jax.random.key(1), rhs, jnp.float32)
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, ((lc, rc), (lb, rb))))
    seconds = bench.call_seconds(f, a, b, reps=reps, pick=statistics.median)
    k = int(np.prod([lhs[d] for d in lc])) if lc else 1
    out = int(np.prod(jax.eval_shape(f, a, b).shape))
    return 2.0 * out * k / seconds / 1e9


def computations(hlo: str) -> dict:
    """computation name -> its body text."""
    out, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if m:
            name, body = m.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(body)
            name = None
        elif name:
            body.append(line)
    return out


def inner_dots(instr: dict, comps: dict, name: str) -> list[str]:
    """The `dot` instructions a thunk runs: itself, or those inside the computation its fusion calls."""
    _, op, _, rest = instr[name]
    if op == "dot":
        return [name]
    m = re.search(r"calls=%(\S+?)[,\s]", rest + " ")
    body = comps.get(m.group(1), "") if m else ""
    return [d.group(1) for d in re.finditer(r"%(\S+) = \S+ dot\(", body)]


def classify(instr: dict, comps: dict, name: str) -> tuple[str, float]:
    """(class, dot FLOPs) of one thunk."""
    if name not in instr:
        return "other", 0.0
    _, op, _, rest = instr[name]
    dots = inner_dots(instr, comps, name)
    if dots:
        fl = [dot_flops(instr, d) for d in dots]
        return ("dot (batched)" if any(b for _, b in fl) else "dot (matmul)"), sum(f for f, _ in fl)
    if op in ("copy", "transpose") or (op == "fusion" and "transpose" in name):
        return "copy / transpose", 0.0
    if op == "fusion":
        return "fusion", 0.0
    return "other", 0.0


def profile(fn, args, hlo: str, reps: int = 3) -> dict:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - t)
    traced_wall, per_thunk, share = thunk_times(lambda: fn(*args), shares=True)
    instr, comps = instructions(hlo), computations(hlo)
    cls_s, cls_flops, fusion_ops = collections.Counter(), collections.Counter(), collections.Counter()
    cls_share, dense_s, dense_flops = collections.Counter(), collections.Counter(), collections.Counter()
    for k, v in per_thunk.items():
        c, fl = classify(instr, comps, k)
        cls_s[c] += v
        cls_share[c] += share[k]
        cls_flops[c] += fl
        dots = inner_dots(instr, comps, k) if k in instr else []
        if c == "dot (matmul)" and len(dots) == 1:
            sig = dot_dims(instr, dots[0])
            dense_s[sig] += share[k]  # per dense-dot signature, the wall share of its thunks
            dense_flops[sig] += fl
        if c == "fusion":
            m = re.search(r'op_name="([^"]+)"', instr[k][3])
            fusion_ops[m.group(1).split("/")[-1] if m else "?"] += share[k]
    top = [dict(signature=[list(x) for x in sig], share_s=t, gflop=dense_flops[sig] / 1e9,
                in_program_gflops=dense_flops[sig] / 1e9 / t, standalone_gflops=standalone_gflops(sig))
           for sig, t in dense_s.most_common(6)]
    return dict(wall_s=statistics.median(walls), traced_wall_s=traced_wall, thunk_s=sum(per_thunk.values()),
                by_class_s=dict(cls_s), by_class_share_s=dict(cls_share), dot_flops=dict(cls_flops),
                top_fusions=fusion_ops.most_common(8), top_dense_dots=top,
                matched=sum(v for k, v in per_thunk.items() if k in instr) / max(sum(per_thunk.values()), 1e-12))


def train_inputs(s: bench.Setup, rollout, ref_forward):
    b, st, key = s.batch, s.state, jax.random.key(1)
    pr = (b["prompt"], b["prompt_mask"])
    tokens, cmask, _ = rollout(st.params, *pr, key)
    prompt = jnp.repeat(b["prompt"], s.G, axis=0)
    full = jnp.concatenate([prompt, tokens], axis=1)
    fmask = jnp.concatenate([jnp.ones_like(prompt), cmask], axis=1)
    adv, _ = group_advantages(jnp.asarray(np.linspace(0, 1, s.N * s.G), jnp.float32), s.G, "group")
    ref_logp, ref_ent = ref_forward(st.ref_params, *pr, full, fmask, cmask)
    return (st.params, st.opt_state, st.step, *pr, full, fmask, cmask, adv, ref_logp, ref_ent, key)


def render(out: dict) -> str:
    """The Markdown block of the bench README: one table per shape and what it implies for the 80% goal."""
    rate = out["square_matmul_gflops"]
    lines = [f"Measured by `experiments/bench/profile_train.py` (`profile_train.json`), square 2048^3 matmul "
             f"{rate:.0f} GFLOP/s in the same run. Thunks run concurrently on the 2 cores, so each is also charged "
             "its *wall share*: 1/k of the time while k thunks run at once (the shares add up to the time any "
             "thunk ran, and a rate over the wall share is not halved by a neighbour running beside it).", ""]
    for shape, r in out["shapes"].items():
        total, fl = r["thunk_s"], sum(r["dot_flops"].values())
        shares = r["by_class_share_s"]
        busy = sum(shares.values())
        ceiling = fl / 1e9 / rate
        lines += [f"**{shape}**: training phase {r['wall_s'] * 1e3:.0f} ms wall, {total * 1e3:.0f} ms of thunks "
                  f"({busy * 1e3:.0f} ms with any thunk running; {r['matched']:.0%} mapped to HLO), {fl / 1e9:.1f} "
                  f"GFLOP: {ceiling * 1e3:.0f} ms at the square rate, so the phase runs at "
                  f"{ceiling / r['wall_s']:.0%} of that ceiling; its MLP matmul shape alone runs at "
                  f"{r['mlp_shape_matmul_gflops']:.0f} GFLOP/s.", "",
                  "| class | thunk ms | wall share ms | share of busy time | GFLOP | GFLOP/s of wall share |",
                  "|---|---|---|---|---|---|"]
        for c, v in sorted(shares.items(), key=lambda kv: -kv[1]):
            f = r["dot_flops"].get(c)
            lines.append(f"| {c} | {r['by_class_s'][c] * 1e3:.0f} | {v * 1e3:.0f} | {v / busy:.0%} | "
                         + (f"{f / 1e9:.2f} | {f / 1e9 / v:.0f} |" if f else " | |"))
        dots = r["top_dense_dots"]
        fmt = lambda sig: (f"{'x'.join(map(str, sig[0]))} . {'x'.join(map(str, sig[1]))} "
                           f"(contract {sig[2]}/{sig[3]})")
        lines += ["", "The largest dense dots (lhs . rhs, contracting dims lhs/rhs), in the program (over their wall "
                  "share) and alone on fresh contiguous operands:", "",
                  "| dot | wall share ms | GFLOP | GFLOP/s in the program | GFLOP/s alone |", "|---|---|---|---|---|"]
        lines += [f"| {fmt(d['signature'])} | {d['share_s'] * 1e3:.0f} | {d['gflop']:.2f} | "
                  f"{d['in_program_gflops']:.0f} | {d['standalone_gflops']:.0f} |" for d in dots]
        saved = sum(max(d["share_s"] - d["gflop"] / d["standalone_gflops"], 0.0) for d in dots)
        fusion = shares.get("fusion", 0.0) + shares.get("other", 0.0) + shares.get("copy / transpose", 0.0)
        lines += ["", f"At their standalone rates these dots would free {saved * 1e3:.0f} ms of wall share "
                  f"({saved / busy:.0%} of the busy time). Without a single dot, the fusions, copies and other thunks "
                  f"hold {fusion * 1e3:.0f} ms of wall share, {fusion / ceiling:.0%} of the whole phase's FLOP "
                  "ceiling; the largest by the jax op they end in: "
                  + ", ".join(f"{op} {v * 1e3:.0f} ms" for op, v in r["top_fusions"][:5]) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="tiny,small")
    ap.add_argument("--workdir", default="/tmp/sage_bench")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    out = {"square_matmul_gflops": bench.matmul_gflops(2048, 2048, 2048), "shapes": {}}
    for shape in args.shapes.split(","):
        sh = bench.SHAPES[shape]
        s = bench.Setup(bench.write_checkpoint(shape, args.workdir), sh["T"], sh["group"], "branch", sh["prompts"])
        rollout, ref_forward, train = bench.phase_fns(s)
        inputs = train_inputs(s, rollout, ref_forward)
        r = profile(train, inputs, train.lower(*inputs).compile().as_text())
        r["mlp_shape_matmul_gflops"] = bench.matmul_gflops(s.N * s.G * (sh["T"] + bench.P_LEN), sh["hidden_size"],
                                                           sh["intermediate_size"])
        out["shapes"][shape] = r
    with open(os.path.join(HERE, "profile_train.json"), "w") as f:
        json.dump(out, f, indent=1)
    md = render(out)
    print(md)
    from experiments.readme_blocks import write_block
    write_block(os.path.join(HERE, "README.md"), "profile_train", md)


if __name__ == "__main__":
    main()
