"""Sharding: the RL step on 8 fake CPU devices equals the 1-device step; every leaf follows the rules.

The 8-device runs happen in a subprocess (`tests/sharding_worker.py`) because the device count is
fixed when JAX starts (this pytest process has one CPU device). The unit tests of the mesh / rules
helpers run here.

Tolerances, from first principles. Sharding changes only the order in which partial sums are added
(the fsdp-split model dimension, the tensor-split heads / MLP / vocabulary, the row split of means).
In float32 (unit roundoff u = 6e-8) reordering a sum of n terms moves it by at most ~n u sum|terms|,
typically sqrt(n) u. The tiny model's contractions have n <= 384 and the step's means run over <= 256
tokens, so:
  * metrics: rtol 1e-5 (>= 100x the typical reordering error) with atol 1e-6 for the quantities that are
    differences of O(1e-2) terms and sit near 0 (loss, kl); `logp_diff_*` (sampler-vs-trainer
    log-prob gaps) are themselves float32 noise of ~1e-7..1e-6, so only |diff| <= 1e-5 is asked of them;
  * gradients (Adam's first moment after one step is mu = (1 - b1) g): |d mu| <= 1e-5 max|mu|, since an
    entry's error is set by the size of the terms summed into it, not by the entry itself;
  * params after one AdamW step: p1 = p0 - lr (g / (|g| + eps) + wd p0) (bias-corrected m = g, v = g^2).
    Adam normalises the update, so d p = lr eps / (|g| + eps)^2 d g <= lr d g / (|g| + eps), at most 2 lr:
    an entry with a tiny gradient can move by much more than u. Each entry is therefore checked against
    tol_i = lr min(2, d_g / (|g_i| + eps)) + 4 u |p_i|, with d_g the gradient bound above;
  * sampling is compared exactly: the same keys draw Gumbel noise that does not depend on the sharding
    (threefry is partitionable), and a token flips only if two candidates' perturbed logits tie to
    within ~1e-6, which this seed does not hit (the check would say so).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_env import subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = ["8x1x1", "1x8x1", "2x2x2", "1x2x4"]
LORA_MESHES = ["2x2x2", "1x2x4"]
LR, EPS, B1, U = 1e-3, 1e-8, 0.9, 6e-8
NOISE_METRICS = ("train/logp_diff_mean", "train/logp_diff_max")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    env = subprocess_env(8, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "report.json") as f:
        report = json.load(f)
    names = ["ref"] + MESHES + ["lora_ref"] + ["lora_" + m for m in LORA_MESHES]
    arrays = {name: dict(np.load(out / f"{name}.npz")) for name in names}
    return report, arrays


@pytest.mark.parametrize("mesh", MESHES + ["lora_" + m for m in LORA_MESHES])
def test_step_equals_single_device(runs, mesh):
    """One RL step on each mesh equals the unsharded step (full fine-tuning, and LoRA: the adapters are
    the only params and the only optimizer state; the base rides along frozen)."""
    report, arrays = runs
    ref_name = "lora_ref" if mesh.startswith("lora_") else "ref"
    ref, got = arrays[ref_name], arrays[mesh]
    # Sampling: identical tokens and masks.
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_array_equal(got["tokens_mask"], ref["tokens_mask"])
    # Metrics.
    mr, mg = report[ref_name]["metrics"], report[mesh]["metrics"]
    assert mr.keys() == mg.keys()
    for k in mr:
        if k in NOISE_METRICS:
            assert abs(mg[k] - mr[k]) <= 1e-5, (k, mg[k], mr[k])
        else:
            assert mg[k] == pytest.approx(mr[k], rel=1e-5, abs=1e-6), (k, mg[k], mr[k])
    assert mr["train/grad_norm"] < 1.0  # below the clip norm: no clipping factor enters the comparison
    # Gradients, through Adam's first moment.
    mu_keys = [k for k in ref if k.startswith("mu")]
    d_mu = 1e-5 * max(np.abs(ref[k]).max() for k in mu_keys)
    for k in mu_keys:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=d_mu, err_msg=k)
    # Updated params, entry by entry against the Adam-normalised bound.
    d_g = d_mu / (1 - B1)
    for k in (k for k in ref if k.startswith("params")):
        g = np.abs(ref["mu" + k[len("params"):]]) / (1 - B1)
        tol = LR * np.minimum(2.0, d_g / (g + EPS)) + 4 * U * np.abs(ref[k])
        err = np.abs(got[k] - ref[k])
        assert np.all(err <= tol), (k, float(err.max()), float(tol[np.argmax(err - tol)]))


def _expected_spec(shape, axes, mesh_shape):
    """Oracle, written from the rules table independently of sharding.py's helpers."""
    from sage_jax.sharding import LOGICAL_RULES
    sizes = dict(zip(("data", "fsdp", "tensor"), mesh_shape))
    if not axes:
        return []
    out, used = [], set()
    for dim, a in zip(shape, axes):
        rule = None if a is None else LOGICAL_RULES[a]  # None: an unnamed dim (e.g. the LoRA rank)
        names = [rule] if isinstance(rule, str) else list(rule or [])
        names = [n for n in names if n not in used and sizes[n] > 1]
        if names and dim % int(np.prod([sizes[n] for n in names])) == 0:
            used.update(names)
            out.append(names[0] if len(names) == 1 else names)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return out


def _check_tree(shardings, mesh_shape):
    n_var = 0
    for path, rec in shardings.items():
        want = _expected_spec(rec["shape"], rec["axes"], mesh_shape)
        assert rec["spec"] == want, (mesh_shape, path, rec)
        n_var += rec["axes"] is not None
    return n_var


@pytest.mark.parametrize("mesh", MESHES)
def test_every_leaf_follows_the_rules(runs, mesh):
    report, _ = runs
    shape = tuple(int(x) for x in mesh.split("x"))
    born = report["born_" + mesh]["shardings"]
    n = _check_tree(born, shape)
    params = [p for p in born if p.startswith(".params")]
    # Every param, its reference copy and both Adam moments carry the param's logical axes.
    assert n == 4 * len(params)
    for p in params:
        rest = p[len(".params"):]
        for other in (".ref_params", ".opt_state[1][0].mu", ".opt_state[1][0].nu"):
            assert born[other + rest]["spec"] == born[p]["spec"], (mesh, p, other)
    # Scalars (step, rng, Adam's count) are replicated.
    for p in (".step", ".rng", ".opt_state[1][0].count"):
        assert born[p]["spec"] == [], (p, born[p])
    # The step keeps the layout: out == in (so the donated state is reused and it compiles once).
    rec = report[mesh]
    assert rec["before"] == born and rec["after"] == born and rec["after2"] == born
    assert rec["cache_size"] == 1


def test_rules_examples(runs):
    """A few placements written out by hand (tiny model: D=64, H=4, K=2, F=384, V=100)."""
    report, _ = runs
    get = lambda mesh, p: report["born_" + mesh]["shardings"][p]["spec"]
    assert get("1x2x4", ".params['embed']") == ["tensor", "fsdp"]  # V=100 over tensor=4, D=64 over fsdp=2
    assert get("1x2x4", ".params['layers'][0]['attn']['wq']") == ["fsdp", "tensor"]
    assert get("1x2x4", ".params['layers'][0]['attn']['wk']") == ["fsdp"]  # 2 kv heads over tensor=4: replicated
    assert get("2x2x2", ".params['layers'][0]['attn']['wk']") == ["fsdp", "tensor"]
    assert get("2x2x2", ".params['layers'][0]['attn']['wo']") == ["tensor", None, "fsdp"]
    assert get("2x2x2", ".params['layers'][0]['mlp']['w_down']") == ["tensor", "fsdp"]
    assert get("8x1x1", ".params['layers'][0]['mlp']['w_up']") == []  # pure data parallel: replicated
    assert get("1x8x1", ".params['layers'][0]['mlp']['w_up']") == ["fsdp"]


def test_born_sharded_values_equal_eager_init(runs):
    # The same random draws; jit may fuse `0.02 * normal` differently from eager: one ulp of |x| <= 0.1.
    report, _ = runs
    for mesh in MESHES:
        assert report["born_" + mesh]["max_abs_diff_vs_eager"] <= 3e-8


# ------------------------------------------------------------------------------------------ unit (1 device)
def test_mesh_shape_resolution_and_errors():
    from sage_jax import sharding as shd
    assert shd.resolve_shape((1, -1, 2), 8) == (1, 4, 2)
    assert shd.resolve_shape((-1, 1, 1), 8) == (8, 1, 1)
    with pytest.raises(ValueError, match="3 entries"):
        shd.resolve_shape((2, 4), 8)
    with pytest.raises(ValueError, match="at most one entry may be -1"):
        shd.resolve_shape((-1, -1, 2), 8)
    with pytest.raises(ValueError, match="not divisible"):
        shd.resolve_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices, 8 are present"):
        shd.resolve_shape((2, 2, 1), 8)


def test_mesh_is_auto_and_takes_the_remaining_devices():
    import jax
    from jax.sharding import AxisType
    from sage_jax import sharding as shd
    m = shd.make_mesh((1, -1, 1))  # config.mesh.shape, as the loop builds it
    assert m.axis_names == shd.MESH_AXES and m.devices.size == jax.device_count()
    assert tuple(m.axis_types) == (AxisType.Auto,) * 3
    assert shd.make_mesh((-1, 1, 1)).shape["data"] == jax.device_count()


def test_rows_error_names_the_fields():
    import jax
    from sage_jax import sharding as shd
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), shd.MESH_AXES)
    shd.check_rows(5, mesh)
    fake = type("M", (), {"shape": {"data": 2, "fsdp": 4, "tensor": 1}})()
    with pytest.raises(ValueError, match=r"rl.group_size.*data x fsdp = 2 x 4 = 8"):
        shd.check_rows(12, fake, "rows (prompts per step x rl.group_size)")


def test_constrain_is_identity_outside_a_sharded_step():
    import jax.numpy as jnp
    from sage_jax import sharding as shd
    x = jnp.ones((4, 3))
    assert shd.constrain(x, ("batch", None)) is x
    with shd.activation_sharding(None):
        assert shd.constrain(x, ("batch", None)) is x


def test_logical_to_spec_uses_each_mesh_axis_once():
    from jax.sharding import PartitionSpec as P
    from sage_jax import sharding as shd
    assert shd.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert shd.logical_to_spec(("batch", "embed")) == P(("data", "fsdp"), None)
    with pytest.raises(KeyError, match="no entry"):
        shd.logical_to_spec(("nope",))


@pytest.mark.parametrize("mesh", LORA_MESHES)
def test_lora_leaves_follow_the_rules_and_keep_their_layout(runs, mesh):
    """Under LoRA the adapters (A: [in, r], B: [r, out]) are placed by their axes, the rank dim replicated;
    the frozen base keeps hf.load's placement; the step returns the layout it was given and compiles once."""
    report, _ = runs
    rec = report["lora_" + mesh]
    before = rec["before"]
    _check_tree(before, tuple(int(x) for x in mesh.split("x")))
    adapters = [p for p in before if p.startswith(".params")]
    assert len(adapters) == 1 * 7 * 2  # 1 layer (sharding_worker.make_model) x 7 projections x (A, B), nothing else
    assert all("['lora_" in p and p.endswith(("['a']", "['b']")) for p in adapters), adapters[:4]
    for p in adapters:
        rest = p[len(".params"):]
        for other in (".opt_state[1][0].mu", ".opt_state[1][0].nu"):
            assert before[other + rest]["spec"] == before[p]["spec"], (mesh, p, other)
    assert not any(p.startswith(".ref_params") for p in before)  # the reference is the frozen base: no copy
    assert rec["after"] == before and rec["after2"] == before
    assert rec["cache_size"] == 1
