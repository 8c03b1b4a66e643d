"""Two local processes under `jax.distributed` (gloo CPU collectives on 127.0.0.1, 2 fake devices each)
form one 4-device job and run 2 RL steps of the tiny setup; both must report identical metrics, equal
to one process driving the same 4-device mesh.

Between the processes: metrics are replicated outputs of one SPMD program, so they are the same
bits on every host. Against the 1-process run: the partitioning is the same, only the all-reduce
implementation (gloo vs in-process) may add partial sums in another order; the step-2 metrics depend
on params after one Adam step, so they get the tolerance argued in tests/test_sharding.py (rtol 1e-5,
atol 1e-6; the float32-noise metrics logp_diff_* |diff| <= 1e-5).
"""

import json
import os
import socket
import subprocess
import sys

import pytest
from xla_env import subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multihost_worker.py")
NOISE_METRICS = ("train/logp_diff_mean", "train/logp_diff_max")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    return subprocess_env(devices, TF_CPP_MIN_LOG_LEVEL="3")


def _start(tmp, nproc, pid, port, devices):
    out = tmp / f"p{nproc}_{pid}.json"
    cmd = [sys.executable, WORKER, "--num-processes", str(nproc), "--process-id", str(pid), "--port", str(port),
           "--out", str(out)]
    return subprocess.Popen(cmd, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def _finish(proc, out, timeout=600):
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"worker timed out:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    with open(out) as f:
        return json.load(f)


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    procs = [_start(tmp_path, 2, i, port, 2) for i in range(2)]
    p0, p1 = [_finish(*p) for p in procs]
    ref = _finish(*_start(tmp_path, 1, 0, 0, 4))

    # Per-host data and per-host rewards: each process loaded and verified only its own half.
    assert p0["rows"] == [0, 2] and p1["rows"] == [2, 4] and ref["rows"] == [0, 4]
    assert p0["verified_rows"] == p1["verified_rows"] == 16  # 2 steps x 8 of the 16 rows
    assert ref["verified_rows"] == 32
    assert p0["cache_size"] == p1["cache_size"] == 1

    assert p0["metrics"] == p1["metrics"] and p0["param_sq"] == p1["param_sq"]
    for s, (got, want) in enumerate(zip(p0["metrics"], ref["metrics"])):
        assert got.keys() == want.keys()
        for k in want:
            if k in NOISE_METRICS:
                assert abs(got[k] - want[k]) <= 1e-5, (s, k, got[k], want[k])
            else:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (s, k, got[k], want[k])
    assert p0["param_sq"] == pytest.approx(ref["param_sq"], rel=1e-6)
    assert int(p0["metrics"][1]["rollout/tokens"]) > 0


def test_maybe_initialize_single_process_is_a_no_op(monkeypatch):
    from sage_jax import distributed
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
              distributed.ENV_AUTO):
        monkeypatch.delenv(k, raising=False)
    assert distributed.maybe_initialize() is False
    assert distributed.maybe_initialize(num_processes=1) is False


def test_maybe_initialize_errors_name_the_variables(monkeypatch):
    from sage_jax import distributed
    monkeypatch.delenv(distributed.ENV_COORDINATOR, raising=False)
    monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID"):
        distributed.maybe_initialize(num_processes=2)
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID=5 must be in \[0, 2\)"):
        distributed.maybe_initialize("127.0.0.1:1", 2, 5)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.maybe_initialize()
