"""Generated blocks of Markdown files: the measured tables a script writes, and a test checks, between

    <!-- BEGIN GENERATED: name (written by <script>; do not edit) -->
    ...
    <!-- END GENERATED: name -->

`write_block` replaces one block's body (the markers must already be in the file); `read_block` returns it.
"""

from __future__ import annotations

import re
from pathlib import Path


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- END GENERATED: "
                      rf"{re.escape(name)} -->)", re.S)


def read_block(path: str | Path, name: str) -> str:
    m = _pattern(name).search(Path(path).read_text())
    if m is None:
        raise KeyError(f"{path}: no generated block {name!r}")
    return m.group(2)


def write_block(path: str | Path, name: str, body: str) -> None:
    path = Path(path)
    text = path.read_text()
    if not _pattern(name).search(text):
        raise KeyError(f"{path}: no generated block {name!r} (add its BEGIN / END markers first)")
    body = body if body.endswith("\n") else body + "\n"
    path.write_text(_pattern(name).sub(lambda m: m.group(1) + body + m.group(3), text, count=1))
