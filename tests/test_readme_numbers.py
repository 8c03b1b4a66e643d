"""The README's measured numbers are generated: each block equals what its script renders from the committed
results file, and configs/tiny.py's "Expected" line quotes the same file."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the studies import each other as experiments.<study>

from experiments.readme_blocks import read_block  # noqa: E402


def _module(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(os.path.dirname(path)), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("block,script", [("demo", "experiments/demo/run.py"),
                                          ("learning_parity", "experiments/learning_parity/run.py"),
                                          ("varlen", "experiments/varlen/run.py")])
def test_readme_block_is_its_results_file(block, script):
    mod = _module(os.path.join(ROOT, script))
    results = json.loads(open(os.path.join(os.path.dirname(os.path.join(ROOT, script)), "results.json")).read())
    assert read_block(os.path.join(ROOT, "README.md"), block).strip() == mod.render(results).strip()


def test_tiny_config_expected_line_is_the_demo_results():
    mod = _module(os.path.join(ROOT, "experiments/demo/run.py"))
    results = json.loads(open(os.path.join(ROOT, "experiments/demo/results.json")).read())
    src = open(os.path.join(ROOT, "configs", "tiny.py")).read()
    assert mod.expected_line(results) in " ".join(src.split()), mod.expected_line(results)


def test_demo_results_are_self_consistent():
    """The gains in the file are after - before of the same file (paired means), per seed; the file names the
    commit it was measured at, a clean checkout of this history."""
    import re
    import subprocess
    results = json.loads(open(os.path.join(ROOT, "experiments/demo/results.json")).read())
    assert re.fullmatch(r"[0-9a-f]{40}", results["commit"]), results["commit"]  # "+dirty": not a checkout
    if os.path.isdir(os.path.join(ROOT, ".git")):
        p = subprocess.run(["git", "merge-base", "--is-ancestor", results["commit"], "HEAD"], cwd=ROOT)
        assert p.returncode == 0, f"{results['commit']} is not in this checkout's history"
    for seed, r in results["seeds"].items():
        for k, g in r["gain"].items():
            assert abs(g["mean"] - (r["after"][k]["mean"] - r["before"][k]["mean"])) < 1e-9, (seed, k)
            assert g["lo"] <= g["mean"] <= g["hi"]


def test_readme_bench_table_is_its_results_files():
    here = os.path.join(ROOT, "experiments", "bench")
    mod = _module(os.path.join(here, "report.py"))
    assert read_block(os.path.join(ROOT, "README.md"), "bench").strip() == mod.readme_table(here).strip()
    # each CPU results file's ratio is its own step times' ratio (no typed number in between)
    for f in ("results_quick.json", "results_small.json", "results.json"):
        res = json.load(open(os.path.join(here, f)))
        for shape, r in res.items():
            if isinstance(r, dict) and "speedup" in r:
                assert abs(r["speedup"] - r["trl_step_s"] / r["ours_step_s"]) < 1e-9, (f, shape)


def test_readme_varlen_bench_is_its_results_file():
    """The README's variable-length block is bench.py's rendering of results.json's `varlen` section, whose ratios
    are its own step times' (ours = the faster real-token setting, each a median of its alternating steps)."""
    import statistics
    here = os.path.join(ROOT, "experiments", "bench")
    mod = _module(os.path.join(here, "report.py"))
    res = json.load(open(os.path.join(here, "results.json")))
    assert read_block(os.path.join(ROOT, "README.md"), "bench_varlen").strip() == mod.varlen_markdown(res).strip()
    for shape, r in res["varlen"].items():
        medians = {k: statistics.median(v) for k, v in r["step_s"].items()}
        assert r["ours_setting"] == min((k for k in medians if k != "padded"), key=medians.get), shape
        assert r["ours_step_s"] == medians[r["ours_setting"]] and r["padded_step_s"] == medians["padded"], shape
        assert abs(r["speedup_vs_padded"] - r["padded_step_s"] / r["ours_step_s"]) < 1e-9, shape
        assert abs(r["speedup_vs_trl"] - r["trl_step_s"] / r["ours_step_s"]) < 1e-9, shape
        assert set(r["useful_fraction"]) == {"decode", "reference", "old", "policy"}, shape


def test_memory_and_decode_tables_are_their_results_files():
    """memory_plan_long.md and decode_floor.md are what their scripts render from the committed .json, and
    the README's paper-scale peaks are that file's rows (to the README's one decimal)."""
    mp, df = _module(os.path.join(ROOT, "experiments/memory_plan.py")), _module(os.path.join(ROOT, "experiments/decode_floor.py"))
    saved = json.load(open(os.path.join(ROOT, "experiments/memory_plan_long.json")))
    text, rows = mp.render(saved["records"], mp.LONG_POINTS, [2, 4], saved["backend"], saved.get("check"))
    assert open(os.path.join(ROOT, "experiments/memory_plan_long.md")).read() == text
    readme = open(os.path.join(ROOT, "README.md")).read()
    for r in rows:
        assert f"| {r['peak'] / mp.GIB:.1f} | {'yes' if mp.fits(r['peak'], 'H100') else 'no'} |" in readme, r["opts"]
    dsaved = json.load(open(os.path.join(ROOT, "experiments/decode_floor.json")))
    assert open(os.path.join(ROOT, "experiments/decode_floor.md")).read() == df.render(dsaved["records"], dsaved["backend"])


def test_bench_readme_tables_are_results_md():
    """The bench README's result tables are copied from results.md, which bench.py wrote with results.json."""
    here = os.path.join(ROOT, "experiments", "bench")
    md, readme = open(os.path.join(here, "results.md")).read(), open(os.path.join(here, "README.md")).read()
    tables = [t for t in md.split("\n\n") if t.startswith("| shape |")]
    assert len(tables) >= 3 and all(t.strip() in readme for t in tables)


def test_bench_readme_training_profile_is_its_results_file():
    """The per-op profile of the training phase in the bench README is what profile_train.py renders from the
    profile_train.json it wrote."""
    here = os.path.join(ROOT, "experiments", "bench")
    mod = _module(os.path.join(here, "profile_train.py"))
    results = json.loads(open(os.path.join(here, "profile_train.json")).read())
    assert read_block(os.path.join(here, "README.md"), "profile_train").strip() == mod.render(results).strip()
    for r in results["shapes"].values():  # the classes partition the thunks, and the counted FLOPs are the dots'
        assert abs(sum(r["by_class_s"].values()) - r["thunk_s"]) < 1e-6 and set(r["dot_flops"]) >= {"dot (matmul)"}


def test_training_profile_reads_a_dots_dimensions_from_the_compiled_program():
    """profile_train's per-dot table names each dot by the operand shapes and dimension numbers it parses from the
    compiled HLO, and times that signature alone; a batched dot with known shapes must parse back exactly."""
    import jax
    import jax.numpy as jnp

    mod = _module(os.path.join(ROOT, "experiments", "bench", "profile_train.py"))
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))))
    a, b = jnp.ones((3, 5, 7)), jnp.ones((3, 7, 4))
    instr = mod.instructions(f.lower(a, b).compile().as_text())
    dots = [n for n, v in instr.items() if v[1] == "dot"]
    assert len(dots) == 1
    sig = mod.dot_dims(instr, dots[0])
    assert sig == ((3, 5, 7), (3, 7, 4), (2,), (1,), (0,), (0,))
    assert mod.dot_flops(instr, dots[0]) == (2.0 * 3 * 5 * 4 * 7, True)
    assert mod.standalone_gflops(sig, reps=2) > 0
