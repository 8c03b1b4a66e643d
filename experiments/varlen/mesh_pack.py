"""Packing on a mesh (not a test: ~9 min of compile on 2 CPU cores): one RL step of tests/sharding_worker.py's
setup with rl.pack_buckets = 2 and two minibatches, on 8 fake CPU devices as mesh 2x2x2, against the 1-device step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/varlen/mesh_pack.py

Prints the metrics that differ beyond rtol 1e-4, Adam's first moment's largest difference over max|mu| (the
gradients; test_sharding's bound is 1e-5), whether the sampled tokens agree and the mesh step's compilations.
"""

import dataclasses
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import sharding_worker as W  # noqa: E402

_parts = W.parts


def parts():
    cfg, tx, lr_fn = _parts()
    return dataclasses.replace(cfg, pack_buckets=2, num_minibatches=2), tx, lr_fn


def main():
    W.parts = parts  # run() builds its config through the module's parts()
    out, report = tempfile.mkdtemp(), {}
    W.run(None, out, report)
    W.run((2, 2, 2), out, report)
    a, b = report["ref"]["metrics"], report["2x2x2"]["metrics"]
    print("metrics beyond rtol 1e-4:", {k: (a[k], b[k]) for k in a if not np.isclose(a[k], b[k], rtol=1e-4, atol=1e-6)})
    ref, got = np.load(os.path.join(out, "ref.npz")), np.load(os.path.join(out, "2x2x2.npz"))
    mu = [k for k in ref.files if k.startswith("mu")]
    scale = max(np.abs(ref[k]).max() for k in mu)
    print("max |d mu| / max |mu|:", max(float(np.abs(ref[k] - got[k]).max()) for k in mu) / scale)
    print("tokens equal:", bool((ref["tokens"] == got["tokens"]).all()), "| mesh compilations over 2 steps:",
          report["2x2x2"]["cache_size"], "| loss:", a["train/loss"], b["train/loss"])


if __name__ == "__main__":
    main()
