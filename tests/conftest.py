import os
import sys

# Tests run on CPU, offline, with a single host device unless a test file sets XLA_FLAGS itself
# (the sharding tests run in subprocesses for that reason).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
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
