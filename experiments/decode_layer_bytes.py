"""Where one decode layer's compiled bytes go, against the analytic ones (not a test; experiments/decode_floor.py
reports the whole step).

    PYTHONPATH=/tmp/libtpu python experiments/decode_layer_bytes.py [--model 1.5B] [--rows 64]

The decode step of `decode_floor.py` is compiled by libtpu (deviceless v5p, bf16, all layers); its
`cost_analysis()` bytes are set beside the analytic ones (weights plus the KV cache slots read). Its top-level
HLO ops are then summed by class, each op counted as its operands' plus its output's bytes: an attribution of
where the excess sits, not a measurement
(an op that reads part of an operand is counted whole; the embedding gather is left out for that reason, and
the LM head, which reads the whole table, is its own class).
Writes decode_layer_bytes.json and decode_layer_bytes.md beside this file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: studies import each other as experiments.<study>

from experiments import decode_floor  # noqa: E402

_DT = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1, "u32": 4, "s8": 1, "u8": 1}


def _bytes(shape: str) -> int:
    total = 0
    for m in re.finditer(r"(bf16|f32|s32|pred|u32|s8|u8)\[([\d,]*)\]", shape):
        n = 1
        for x in m.group(2).split(","):
            n *= int(x) if x else 1
        total += n * _DT[m.group(1)]
    return total


def compiled_step(model: str, rows: int, layers: int):
    """(record of decode_floor.compile_step, compiled HLO text) with `layers` layers."""
    import jax
    decode_floor.MODELS[model] = {**decode_floor.MODELS[model], "num_layers": layers}
    seen = {}
    jit = jax.jit

    def capturing_jit(*a, **k):  # decode_floor.compile_step calls jax.jit(...).lower(...).compile()
        lowered_fn = jit(*a, **k)

        class Lowerable:
            def lower(self, *args):
                lowered = lowered_fn.lower(*args)

                class Compilable:
                    def compile(self):
                        seen["compiled"] = lowered.compile()
                        return seen["compiled"]
                return Compilable()
        return Lowerable()

    jax.jit = capturing_jit
    try:
        rec = decode_floor.compile_step(model, rows, "tpu")
    finally:
        jax.jit = jit
    return rec, seen["compiled"].as_text()


def classify(hlo: str, vocab: int) -> dict[str, int]:
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    defs = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*?)\)(, .*)?$", line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    out = collections.Counter()
    for name, (shape, op, operands) in defs.items():
        if op in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast") or "gather" in name:
            continue
        names = [o for o in re.findall(r"%([^\s,)]+)", operands) if o in defs]
        b = _bytes(shape) + sum(_bytes(defs[o][0]) for o in names)
        if any(f"[{vocab}," in defs[o][0] for o in names):
            out["LM head (reads the embedding table; outside the layer)"] += b
        elif op in ("copy-start", "copy-done"):
            out["weight prefetch copies (copy-start / copy-done)"] += b
        elif name.startswith("copy_dynamic-update-slice"):
            out["copy-update of the current cache segment"] += b
        elif re.search(r"f32\[[\d,]*,%d\]" % (decode_floor.P + decode_floor.T - 1), shape):
            out["f32 scores / probabilities over all slots"] += b
        else:
            out["everything else"] += b
    return dict(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.5B")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    layers = decode_floor.MODELS[args.model]["num_layers"]
    rec, hlo = compiled_step(args.model, args.rows, layers)
    analytic = rec["weight_bytes"] + rec["kv_read_bytes"]
    vocab = decode_floor.MODELS[args.model]["vocab_size"]
    out = {"model": args.model, "rows": args.rows, "layers": layers, "step": rec, "attribution": classify(hlo, vocab)}
    with open(os.path.join(HERE, "decode_layer_bytes.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"{args.model} ({layers} layers), {args.rows} rows, one decode step (libtpu, deviceless v5p, bf16): "
             f"compiled {rec['bytes_accessed'] / 1e9:.2f} GB, analytic {analytic / 1e9:.2f} GB (weights "
             f"{rec['weight_bytes'] / 1e9:.2f} + KV read {rec['kv_read_bytes'] / 1e9:.2f}), "
             f"{rec['bytes_accessed'] / analytic:.2f}x", "",
             "| class (operands + output per top-level op; an attribution, not a measurement) | GB |", "|---|---|"]
    lines += [f"| {k} | {v / 1e9:.2f} |" for k, v in sorted(out["attribution"].items(), key=lambda kv: -kv[1])]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, "decode_layer_bytes.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
