"""The training loop under `jax.distributed`: two local processes (gloo CPU collectives on 127.0.0.1,
2 fake devices each, one 4-device job) run `python -m sage_jax.main` on the tiny config, checkpoint
at steps 2 and 4 into one shared workdir (as a pod shares gs://); a second 2-process run resumes a copy of
that workdir as a preemption right after step 2 leaves it.

The resumed run must equal the uninterrupted 2-process run of 4 steps bit for bit (metrics.jsonl
without `perf/` keys, and the exported safetensors bytes). Bit-identity is expected, not just
closeness: both runs are the same SPMD programs on the same 4-device mesh with the same
partitioning, so every reduction (including gloo's cross-process all-reduce, whose order is fixed
by the ring over the same 4 devices) adds the same partial sums in the same order; the checkpoint
stores params, optimizer state, step and RNG key data exactly (float32 round-trips through
tensorstore unchanged), and the data iterator's position is restored, so steps 3-4 see the same
inputs and the same RNG. Nothing in the step depends on wall time or on the process's history
(compilation caches only change speed).
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from run_copies import preempted_copy
from sage_jax.models.tiny import write_random_init
from sage_jax.train.metric_writer import read_metrics
from xla_env import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "train_worker.py")
TIMEOUT_S = 300  # per 2-process run (each takes well under a minute on 2 idle cores)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # one layer: the loop's machinery is under test, not what it learns (a third less time per run)
    return write_random_init(str(tmp_path_factory.mktemp("init") / "tiny"), seed=0, num_layers=1)


@pytest.fixture(scope="module")
def data_dir(tiny_task_data_dir):
    # Prepared before the processes start (conftest): two processes preparing one TFDS directory would race.
    return tiny_task_data_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(workdir, base, data_dir, steps):
    return [sys.executable, WORKER, f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.model.path={base}", f"--config.data.data_dir={data_dir}", f"--config.max_steps={steps}",
            "--config.checkpoint_every=2", "--config.log_every=1", "--config.rl.reward=exact_match",
            "--config.eval.at_start=False", "--config.eval.at_end=False", "--config.eval_every=0",
            "--config.ckpt.async_save=False", "--config.logging.progress=False",
            "--config.logging.tensorboard=False", "--config.data.batch_size=4", "--config.rollout.group_size=4",
            "--config.rollout.max_new_tokens=16"]


def _env(port, pid):
    return dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(pid), XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu",
                TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")


def _run2(workdir, base, data_dir, steps, logdir):
    """Both processes at once; returns process 0's JSON summary. Kills both on any failure or timeout."""
    port = _free_port()
    procs, logs = [], []
    try:
        for pid in range(2):
            # logs go to files, not pipes: a full pipe would stall one process and, through the
            # collectives, the other
            log = open(os.path.join(logdir, f"{os.path.basename(workdir)}_{steps}_p{pid}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(_cmd(workdir, base, data_dir, steps), env=_env(port, pid), stdout=log,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.time() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                pytest.fail(f"process {bad[0]} exited with {procs[bad[0]].returncode}:\n{_tail(logs[bad[0]])}")
            if time.time() > deadline:
                pytest.fail(f"2-process run timed out after {TIMEOUT_S}s:\n" + "\n".join(map(_tail, logs)))
            time.sleep(0.1)
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{_tail(logs[i])}"
        logs[0].seek(0)
        lines = [ln for ln in logs[0].read().splitlines() if ln.startswith("{")]
        assert lines, _tail(logs[0])
        return json.loads(lines[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()


def _tail(log, n=4000):
    log.flush()
    log.seek(0)
    return log.read()[-n:]


def _strip_perf(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_two_process_checkpoint_resume_is_exact(base, data_dir, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    logdir = str(tmp_path)

    whole = _run2(a, base, data_dir, 4, logdir)
    assert whole["start_step"] == 0 and whole["end_step"] == 4
    assert sorted(os.listdir(os.path.join(a, "checkpoints"))) == ["2", "4"]

    # b: that run as a preemption right after checkpoint 2 would have left it (metrics of steps 1-2, no later
    # checkpoint, no export); the resumed 2-process run must continue it to a's steps 3-4 exactly.
    preempted_copy(a, b, drop=("checkpoints/4", "export_hf"), keep_lines=2)
    assert [r["step"] for r in read_metrics(b)] == [1, 2]
    resumed = _run2(b, base, data_dir, 4, logdir)
    assert resumed["start_step"] == 2 and resumed["end_step"] == 4

    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == [1, 2, 3, 4]  # one writer: no duplicate lines
    assert _strip_perf(ma) == _strip_perf(mb)
    assert int(ma[-1]["rollout/tokens"]) > 0
    with open(os.path.join(a, "export_hf", "model.safetensors"), "rb") as fa, \
            open(os.path.join(b, "export_hf", "model.safetensors"), "rb") as fb:
        assert fa.read() == fb.read()
    # and the 4 steps did move the params (the comparison above is not of two copies of the init)
    from safetensors.numpy import load_file
    got = load_file(os.path.join(a, "export_hf", "model.safetensors"))
    init = load_file(os.path.join(base, "model.safetensors"))
    assert got.keys() == init.keys() and any((got[k] != init[k]).any() for k in got)
