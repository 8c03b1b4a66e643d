"""Final answers in text: `\\boxed{...}` extraction shared by the verifier, the exact-match reward, the
evaluation's majority vote and the data sources, so all of them read the same answer from a completion.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np


def to_text(x: Any, max_chars: int | None = None) -> str:
    """Any input as a clean `str` (its last `max_chars` characters): bytes decoded leniently,
    lone surrogates replaced, None -> ''."""
    if x is None:
        return ""
    if isinstance(x, (bytes, bytearray, memoryview)):
        x = bytes(x).decode("utf-8", errors="replace")
    elif isinstance(x, np.generic):
        x = x.item()
        if isinstance(x, bytes):
            x = x.decode("utf-8", errors="replace")
    if not isinstance(x, str):
        x = str(x)
    if max_chars is not None:
        x = x[-max_chars:]
    # Lone surrogates (from invalid UTF-8 decoded with `surrogateescape`) break encoders downstream.
    return x.encode("utf-8", errors="replace").decode("utf-8")



def normalize_whitespace(text: str) -> str:
    """Collapse runs of whitespace into one space and strip the ends."""
    return " ".join(text.split())


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced_group(text: str, start: int) -> str | None:
    """Content of the `{...}` group opening at `text[start]`, or None if it never closes.

    A backslash escapes the next character, so `\\{` and `\\}` do not count as braces (as in TeX),
    while `\\\\{` (a line break, then a brace) does.
    """
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _box_content(text: str, pos: int) -> str | None:
    """Argument of a `\\boxed` whose name ends at `pos`, or None when it never closes."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        return _braced_group(text, pos)
    return re.match(r"[^\s$]*", text[pos:]).group(0)  # `\boxed 5`: one token, up to `$`


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`, or the TeX short form `\\boxed 5`),
    stripped; "" for an empty box; None when there is none.

    Braces are matched by hand because math-verify merges several boxed answers into one set. A last
    box that never closes (a truncated generation) falls back to the previous complete one.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        content = _box_content(text, match.end())
        if content is not None:
            return content.strip()
    return None


def extract_boxed_answer(completion: str) -> str | None:
    """`last_boxed`, whitespace-normalised, None for an empty box: the answer a majority vote counts."""
    content = last_boxed(completion)
    if content is None:
        return None
    return normalize_whitespace(content) or None
