import os
import sys

# Tests run on CPU, offline, with a single host device unless a test file sets XLA_FLAGS itself
# (the sharding tests run in subprocesses for that reason).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# models.auto_tokenizer's remembered verdicts: one file for the suite's processes, not the user's ~/.cache
os.environ.setdefault("SAGE_JAX_CACHE", os.path.join("/tmp", f"sage_jax_test_cache_{os.getuid()}"))
sys.path.insert(0, os.path.dirname(__file__))
from xla_env import FAST_COMPILE  # noqa: E402

# Faster XLA:CPU compilation for this process and every child that inherits os.environ (tests/xla_env.py).
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()
# The notebooks' helpers (gpu_estimates, notebook_utils) live beside the notebooks, outside the package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def x64():
    """float64 for a test module (`pytestmark = pytest.mark.usefixtures("x64")`): references computed in
    float64 make an fp32 op's error visible; restored after the module."""
    import jax

    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", prev)


# Longest first. The suite's wall clock on CI's 2 cores is set by how the two xdist workers share ~50 minutes of
# work: `make test` hands whole files out (--dist loadfile) in collection order (--no-loadscope-reorder; xdist's
# default orders by test count, which put the 10-minute training-loop file last). These files take 40 s to
# 10 min of worker time each (`--durations=0`, heaviest first); everything else, seconds, follows in file order.
HEAVY_FIRST = ("test_train.py", "test_rl_step.py", "test_cli.py", "test_official_recipe.py", "test_train_lora.py",
               "test_sage_miniature.py", "test_sharding.py", "test_notebooks.py", "test_length_buckets.py",
               "test_learning.py", "test_prompt_sharing.py", "test_multihost_resume.py", "test_eval_mode.py",
               "test_sampling.py", "test_multihost.py", "test_mesh_axis_types.py", "test_dapo.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: order within a file kept


@pytest.fixture(scope="session")
def tiny_task_data_dir(tmp_path_factory):
    """The TFDS copy of configs/tiny.py's task (`procedural_arithmetic`, config `strategies`, both splits),
    prepared once for the whole suite (~11 s each time otherwise) and then only read. The xdist workers share
    it: the first to take the lock prepares it, the others wait and reuse it."""
    import fcntl

    from sage_jax.data import builders
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above every worker's own
    d = root / "shared_tiny_task_tfds"
    with open(root / "shared_tiny_task_tfds.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for split in ("train", "test"):
            builders.load_split("procedural_arithmetic", split, data_dir=str(d), config="strategies")
    return str(d)
