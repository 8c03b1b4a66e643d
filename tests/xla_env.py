"""The XLA flags every test process runs under, the pytest process and the subprocesses it starts alike.

The suite's time is mostly XLA:CPU compiling small programs (the tiny RL step compiles in ~8 s and runs in
well under one). The LLVM backend at -O0, without its expensive passes, compiles them ~25-30% faster (measured
on tests/test_rl_step.py: 82 s -> 58 s). These flags change how the optimised HLO is lowered to machine code,
not the HLO program, so every parity and exactness check means what it did. Benchmarks and experiments run at
XLA's defaults; only the tests use these.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int | None = None) -> str:
    """The test flags, with `devices` fake CPU devices when given (fixed when JAX starts, hence per process)."""
    return FAST_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices else "")


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
    """os.environ for a child JAX process on CPU: the test flags replace whatever XLA_FLAGS the parent has (a
    forced device count must not leak into a child that expects one device)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices), **extra)
