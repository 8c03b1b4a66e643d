"""`hf.load` and the sampler accept a mesh from `jax.make_mesh` with its default (Explicit) axis types, which
used to crash the first forward with a ShardingTypeError; a mesh with other axis names is refused in one line.
Runs in a subprocess with 4 fake CPU devices (the device count is fixed when JAX starts)."""

import os
import subprocess
import sys

CODE = r"""
import jax, numpy as np
from sage_jax.config_lib import TINY_BASE
from sage_jax.models import hf
from sage_jax.models.config import ConfigError
from sage_jax.sampling import SamplingConfig, TextSampler
mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"))
assert any(str(t).endswith("Explicit") for t in mesh.axis_types), mesh.axis_types  # the default we must accept
toks = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], np.int32)
ref = np.asarray(hf.load(TINY_BASE)[0](toks))
model, _ = hf.load(TINY_BASE, mesh=mesh)
got = np.asarray(model(toks))
assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
tok = hf.load_tokenizer(TINY_BASE)
s = TextSampler(model, tok, SamplingConfig(max_new_tokens=8, temperature=0.0, eos_ids=(2,), pad_id=0), batch_size=4, mesh=mesh)
assert len(s.generate(["Compute 1+2."], n=4, seed=0)[0]) == 4
try:
    hf.load(TINY_BASE, mesh=jax.make_mesh((2, 2), ("x", "y")))
    raise SystemExit("a mesh with other axis names was accepted")
except ConfigError as e:
    assert "data" in str(e) and "\n" not in str(e), str(e)
print("OK")
"""


def test_make_mesh_default_axis_types_work():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
