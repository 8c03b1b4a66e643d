"""math-verify in a process pool: the verifier behind the `math_verify` reward (`sage_jax.rewards.verifiers`).

`VerifierPool.verify(completions, answers)` scores a batch: a float32 numpy array of 1.0 / 0.0 plus
counts; it never raises or hangs. `sage_jax.rewards.verifiers.math_verify_reward` runs it on `default_pool()`.

Why a process pool: sympy can spend unbounded time inside C code (`9^{9^{9^9}}`) where no signal
reaches it, and math-verify's own `signal.alarm` timeouts only work on the main thread. Each
sample therefore runs in a worker process with a hard wall-clock deadline measured by the parent;
a worker past its deadline is killed and replaced, and its sample scores 0.0 (fail closed).
Workers start through `forkserver` (never `fork`: forking after JAX has started its threads can
deadlock) with math-verify preloaded into the server, so a replacement is ready in milliseconds.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import threading
import time
import types
from collections import deque
from typing import Any, Sequence

import numpy as np

from sage_jax.rewards.boxed import to_text, verifier_text
from sage_jax.rewards.worker import DEFAULT_TIMEOUT_S, MAX_COMPLETION_CHARS, MODES, worker_main

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- parent side


@dataclasses.dataclass
class RewardStats:
    """Counts for one call (or cumulative for a pool). `errors` counts exceptions and crashes."""

    n: int = 0
    correct: int = 0
    timeouts: int = 0
    errors: int = 0
    no_answer: int = 0
    gold_unparsed: int = 0
    rejected: int = 0  # predictions too costly to parse (`too_costly`), compared as text
    seconds: float = 0.0
    # per sample of one call: "ok", "no_answer", "rejected", "timeout", "gold_unparsed", "error:..."
    statuses: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    def _counts(self):
        return [f for f in dataclasses.fields(self) if f.name != "statuses"]

    def add(self, other: "RewardStats") -> None:
        for f in self._counts():
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {prefix + f.name: getattr(self, f.name) for f in self._counts()}


_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden():
    """Start children without re-running the parent's `__main__` in them.

    spawn / forkserver children re-import the main module (a training script importing JAX, or
    one without an `if __name__ == "__main__"` guard, which would start training again in every
    worker). The worker needs only this module, importable by name, so `__main__` is swapped for
    an empty module for the few milliseconds of `Process.start()`.
    """
    with _START_LOCK:
        real = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real


def as_batch(x: Any) -> list:
    """A batch argument as a list: None -> [], one string (or bytes) -> [it], any other iterable -> its items,
    anything else -> [it]."""
    if x is None:
        return []
    if isinstance(x, (str, bytes, bytearray)):
        return [x]
    try:
        return list(x)
    except TypeError:
        return [x]


class _Worker:
    def __init__(self, ctx: Any) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main, args=(child_conn,), daemon=True)
        with _main_module_hidden():
            self.proc.start()
        child_conn.close()  # so that the parent sees EOF when the worker dies
        self.conn = parent_conn
        self.ready = False
        self.started = time.monotonic()
        self.task: int | None = None
        self.deadline = math.inf

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.join(timeout=1.0)
        with contextlib.suppress(Exception):
            self.conn.close()


def default_num_workers() -> int:
    """The usable cores, at most 16: beyond that a TPU host would hold many idle sympy workers."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


class VerifierPool:
    """A reusable pool of math-verify worker processes with a hard per-sample timeout.

    Create once, call `verify` many times (thread-safe: calls are serialised), `close` at exit.
    `timeout_s` counts from the moment a sample is handed to a worker. `num_workers` defaults to
    `$SAGE_JAX_REWARD_WORKERS`, else `default_num_workers()`.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_method: str = "forkserver",
        start_timeout_s: float = 60.0,
    ) -> None:
        if start_method == "fork":
            raise ValueError("fork after JAX has started its threads can deadlock; use forkserver/spawn")
        if num_workers is None:
            num_workers = int(os.environ.get("SAGE_JAX_REWARD_WORKERS", 0)) or default_num_workers()
        self.num_workers = max(1, int(num_workers))
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a server that already imported sympy / math-verify (~10 ms each).
            self._ctx.set_forkserver_preload(["math_verify", "sage_jax.rewards.worker"])
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._task_seq = 0
        self.restarts = 0
        self.totals = RewardStats()
        self.closed = False

    # -- lifecycle

    def _ensure_workers(self) -> None:
        for w in [w for w in self._workers if not w.proc.is_alive()]:
            w.kill()
            self._workers.remove(w)
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._workers.append(_Worker(self._ctx))
        self.restarts += 1

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                with contextlib.suppress(Exception):
                    w.conn.send(None)
            for w in self._workers:
                w.proc.join(timeout=0.5)
                w.kill()
            self._workers = []
            self.closed = True

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- work

    def verify(
        self,
        completions: Sequence[Any],
        answers: Sequence[Any],
        timeout_s: float | None = None,
        mode: str = "boxed",
    ) -> tuple[np.ndarray, RewardStats]:
        """Score each (completion, gold) pair: float32 1.0 / 0.0, and the call's counts.

        `mode`: "boxed" (the last \\boxed{} of the completion, else math-verify's extraction from its tail;
        golds wrapped in $...$) or "text" (the official SAGE reward: math-verify on the whole text and the
        gold as given)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        t0 = time.monotonic()
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        completions, answers = as_batch(completions), as_batch(answers)
        n = len(completions)
        if len(answers) != n:
            raise ValueError(f"{n} completions but {len(answers)} answers")
        rewards = np.zeros((n,), np.float32)
        stats = RewardStats(n=n, statuses=["error:not_run"] * n)
        if n == 0:
            return rewards, stats
        try:
            with self._lock:
                if self.closed:
                    raise RuntimeError("VerifierPool is closed")
                self._run(completions, answers, timeout, rewards, stats, mode)
        except Exception as e:  # noqa: BLE001  (never raise to the training step: fail closed)
            logger.exception("reward pool failed; scoring the batch as 0: %s", e)
            rewards[:] = 0.0
            stats.errors = n
            stats.correct = 0
            stats.statuses = ["error:pool"] * n
        stats.seconds = time.monotonic() - t0
        self.totals.add(stats)
        return rewards, stats

    def _run(self, completions, answers, timeout, rewards, stats, mode="boxed") -> None:
        pending = deque(range(len(completions)))
        self._ensure_workers()
        tid_to_idx: dict[int, int] = {}
        last_progress = time.monotonic()

        def finish(idx: int, reward: float, status: str) -> None:
            rewards[idx] = reward
            stats.statuses[idx] = status
            if status == "ok":
                stats.correct += int(reward > 0)
            elif status == "timeout":
                stats.timeouts += 1
            elif status in ("no_answer", "gold_unparsed", "rejected"):
                setattr(stats, status, getattr(stats, status) + 1)
            else:
                stats.errors += 1

        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    self._task_seq += 1
                    msg = (
                        self._task_seq,
                        verifier_text(to_text(completions[idx]), MAX_COMPLETION_CHARS),
                        to_text(answers[idx]),
                        mode,
                    )
                    try:
                        w.conn.send(msg)
                    except (OSError, EOFError, ValueError):
                        finish(idx, 0.0, "error:send")
                        self._replace(w)
                        continue
                    w.task, w.deadline = self._task_seq, time.monotonic() + timeout
                    tid_to_idx[self._task_seq] = idx
            if not pending and all(w.task is None for w in self._workers):
                break
            # Sleep until a reply, a worker death, or the nearest deadline.
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            deadlines += [w.started + self.start_timeout_s for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines, default=now + 1.0) - time.monotonic())
            conns = [w.conn for w in self._workers]
            ready_conns = mp_connection.wait(conns, timeout=min(wait_s, 1.0))
            for c in ready_conns:
                w = next((w for w in self._workers if w.conn is c), None)
                if w is None:
                    continue
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    if w.task is not None:  # the worker died on this sample (segfault, OOM kill)
                        finish(tid_to_idx.pop(w.task), 0.0, "error:crash")
                        w.task = None
                    self._replace(w)
                    continue
                last_progress = time.monotonic()
                if msg == ("ready",):
                    w.ready = True
                    continue
                task_id, reward, status = msg
                if task_id == w.task:
                    finish(tid_to_idx.pop(task_id), float(reward), status)
                    w.task, w.deadline = None, math.inf
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now > w.deadline:
                    finish(tid_to_idx.pop(w.task), 0.0, "timeout")
                    w.task = None
                    self._replace(w)  # its process may be stuck in C code: kill it
                elif not w.ready and now > w.started + self.start_timeout_s:
                    self._replace(w)
            stalled = not any(w.ready for w in self._workers)
            if pending and stalled and now - last_progress > self.start_timeout_s:
                # No worker has come up for a long time: fail the rest closed instead of hanging.
                while pending:
                    finish(pending.popleft(), 0.0, "error:no_workers")


_DEFAULT_POOL: VerifierPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def default_pool() -> VerifierPool:
    """The lazily created module-level pool (closed at interpreter exit)."""
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL.closed:
            _DEFAULT_POOL = VerifierPool()
            atexit.register(_DEFAULT_POOL.close)
        return _DEFAULT_POOL
