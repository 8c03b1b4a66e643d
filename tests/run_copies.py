"""A finished run's workdir as a preemption would have left it: the later checkpoints and the exports gone,
metrics.jsonl cut back to its first lines (plus, optionally, the start of the next one, a write cut mid-line)."""

import os
import shutil


def preempted_copy(src: str, dst: str, drop: tuple[str, ...], keep_lines: int, partial_next: bool = False) -> None:
    shutil.copytree(src, dst)
    for name in drop:
        shutil.rmtree(os.path.join(dst, name))
    with open(os.path.join(src, "metrics.jsonl")) as f:
        lines = f.readlines()
    tail = [lines[keep_lines][: len(lines[keep_lines]) // 2]] if partial_next else []
    with open(os.path.join(dst, "metrics.jsonl"), "w") as f:
        f.writelines(lines[:keep_lines] + tail)
