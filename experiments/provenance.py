"""Which code a study's numbers came from: the checked-out commit, "+dirty" when tracked files differ from it."""

from __future__ import annotations

import os
import subprocess


def commit(where: str | os.PathLike = os.path.dirname(os.path.abspath(__file__))) -> str:
    """The commit checked out at `where` (default: this checkout), "+dirty" when tracked files differ."""
    git = lambda *a: subprocess.run(["git", *a], cwd=where, capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout.strip()
    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
