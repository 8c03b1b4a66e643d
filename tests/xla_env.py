"""The XLA flags every test process runs under, the pytest process and the subprocesses it starts alike.

The suite's time is mostly XLA:CPU compiling small programs: the tiny RL step of tests/rl_fixtures.py (M = 2,
beta 0.04) compiles in 13.0 s at XLA's defaults and runs in 0.4 s. With the LLVM backend at -O0 without its
expensive passes it compiles in 8.8 s; with XLA:CPU's older loop emitters in place of the MLIR fusion emitters
(whose output otherwise needs LLVM's optimiser) in 4.6-6.1 s (same 2 busy cores, one process each, the same
loss to 8 digits). These flags change how the optimised HLO is lowered to machine code, not the HLO program,
so every parity and exactness check means what it did. Benchmarks and experiments run at XLA's defaults; only
the tests use these.
"""

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int | None = None) -> str:
    """The test flags, with `devices` fake CPU devices when given (fixed when JAX starts, hence per process)."""
    return FAST_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices else "")


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
    """os.environ for a child JAX process on CPU: the test flags replace whatever XLA_FLAGS the parent has (a
    forced device count must not leak into a child that expects one device)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices), **extra)
