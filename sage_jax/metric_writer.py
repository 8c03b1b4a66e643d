"""One metrics writer, on process 0: DIR/metrics.jsonl, TensorBoard events, optional Weights & Biases.

Each logged step is one JSON line `{"step": N, "train/loss": ..., ...}`. On resume the file is cut back
to the restored step, so a resumed run's metrics file equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


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

    def truncate_after(self, step: int) -> None:
        """Drops lines of steps > `step` (written by a run that died after its last checkpoint)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
        with open(self.path, "w") as f:
            f.writelines(keep)

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
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]
