"""One metrics writer, on process 0: DIR/metrics.jsonl, TensorBoard events, optional Weights & Biases.

Each logged step is one JSON line `{"step": N, "train/loss": ..., ...}`. On resume the file is cut back
to the restored step, so a resumed run's metrics file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import numpy as np

from sage_jax.errors import UserError

log = logging.getLogger(__name__)


def _py(v: Any):
    v = np.asarray(v)
    x = v.item() if v.size == 1 else v.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no nan / inf; keep them visible rather than dropping the key
    return x


class MetricWriter:
    def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True, wandb_cfg: dict | None = None):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        if wandb_cfg:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("logging.wandb=True needs `pip install wandb`") from None
            self._wandb = wandb.init(**wandb_cfg)

    def rows(self) -> list[dict]:
        """The rows on disk (see `read_metrics`); none when disabled or not yet written."""
        if not self.enabled or not os.path.exists(self.path):
            return []
        return read_metrics(os.path.dirname(self.path))

    def truncate_after(self, step: int | None) -> None:
        """Keeps the rows of steps <= `step` (a run that died after its last checkpoint wrote more), or
        none with `step=None` (no checkpoint to resume from: the run starts over). Atomic."""
        if not self.enabled or not os.path.exists(self.path):
            return
        rows = self.rows()
        keep = [r for r in rows if step is not None and r["step"] <= step]
        if len(keep) < len(rows):
            log.warning("%s: dropping %d rows after step %s (not covered by a checkpoint)", self.path,
                        len(rows) - len(keep), step if step is not None else "0 (no checkpoint)")
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": int(step), **{k: _py(v) for k, v in sorted(metrics.items())}}
        if not self.enabled:
            return row
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                if self._tb is not None:
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)  # TB tags allow no "@"
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        return row

    def flush(self):
        if self._tb is not None:
            self._tb.flush()

    def close(self):
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(workdir: str) -> list[dict]:
    """Every row of DIR/metrics.jsonl. A last line cut short (a process killed mid-write) is skipped with a
    warning; a malformed line anywhere else is an error naming the file and line."""
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        lines = f.read().split("\n")
    rows = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            if i >= len(lines) - 2 and not any(x.strip() for x in lines[i + 1:]):
                log.warning("%s: line %d is cut short (a killed write?); ignoring it", path, i + 1)
                continue
            raise MetricsFileError(f"{path}: line {i + 1} is not JSON: {ln[:80]!r}") from None
        if not isinstance(row, dict) or "step" not in row:
            raise MetricsFileError(f"{path}: line {i + 1} has no 'step': {ln[:80]!r}")
        rows.append(row)
    return rows


class MetricsFileError(UserError, ValueError):
    """metrics.jsonl holds a line that is not a metrics row (not a write cut short by a kill)."""
