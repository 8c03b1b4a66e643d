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


_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.S)


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each `{` -> index of the `}` that closes it, in one pass (unclosed ones are absent).

    A backslash escapes the next character, so `\\{` and `\\}` do not count as braces (as in TeX),
    while `\\\\{` (a line break, then a brace) does. Linear in the text (the regex visits only braces and
    escapes), so hostile input (thousands of unclosed `\\boxed{`) costs no more than clean input of its length.
    """
    pairs, stack = {}, []
    for m in _BRACE_TOKENS.finditer(text):
        ch = m.group()
        if ch == "{":
            stack.append(m.start())
        elif ch == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _box_content(text: str, pos: int, pairs: dict[int, int]) -> str | None:
    """Argument of a `\\boxed` whose name ends at `pos`, or None when it never closes."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        close = pairs.get(pos)
        return None if close is None else text[pos + 1:close]
    return re.match(r"[^\s$]*", text[pos:pos + 256]).group(0)  # `\boxed 5`: one token, up to `$`


def _last_box(text: str) -> tuple[str, int] | None:
    """(content, start of its `\\boxed`) of the last complete box, as `last_boxed` reads it; None when none."""
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    pairs = _brace_pairs(text)
    for match in reversed(matches):
        content = _box_content(text, match.end(), pairs)
        if content is not None:
            return content.strip(), match.start()
    return None


def has_box(text: str) -> bool:
    """Whether the text opens a `\\boxed` / `\\fbox` at all (closed or not)."""
    return _BOXED_RE.search(text) is not None


def verifier_text(text: str, max_chars: int) -> str:
    """What a reward reads of a completion: the whole text when it is at most `max_chars` long; else its last
    `max_chars` characters, unless that window cuts a box. Then the last complete box, found on the whole
    text, alone (`\\boxed{...}`), so that it is read whole; or "" when the cut box never closes (the answer
    cannot be read; without this, a box opened before the window read as an unboxed tail, and
    `\\boxed{1+1+...+1}` scored correct for the gold 1)."""
    if len(text) <= max_chars:
        return text
    start = len(text) - max_chars
    box = _last_box(text)
    if box is not None:
        content, at = box
        return text[start:] if at >= start else f"\\boxed{{{content}}}"
    if has_box(text[:start]):  # an opener before the window that never closes
        return ""
    return text[start:]


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`, or the TeX short form `\\boxed 5`),
    stripped; "" for an empty box; None when there is none.

    Braces are matched by hand because math-verify merges several boxed answers into one set. A last
    box that never closes (a truncated generation) falls back to the previous complete one.
    """
    box = _last_box(text)
    return None if box is None else box[0]


def extract_boxed_answer(completion: str) -> str | None:
    """`last_boxed`, whitespace-normalised, None for an empty box: the answer a majority vote counts."""
    content = last_boxed(completion)
    if content is None:
        return None
    return normalize_whitespace(content) or None
