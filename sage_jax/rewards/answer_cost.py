"""The cost guard of the verifier: answers whose parsing could make sympy compute without bound.

`too_costly(text)` is a pure string test, run in the verifier workers before math-verify parses a prediction
(sage_jax.rewards.pool); tests/test_rewards.py holds the cases it must flag and the real answers it must pass.
"""

from __future__ import annotations

import math
import re

# Answers whose mere evaluation is unbounded for sympy (it computes what it parses): a power tower (an
# exponent that holds a power, `10^{10^{10}}`, `{9}^{{9}^{9}}`, `2^3^4`), an exponent of 7+ digits or a
# power of more than _MAX_DIGITS digits (`999999^{999999}`), a factorial of 5+ digits or of a group holding
# a power or a 4+ digit number (`(10^{6})!`), a binomial with a 5+ digit number, Knuth arrows. Text mode
# (the official reward, which parses the whole completion) applies the same test to the whole text. Such a
# prediction is compared with the gold as text and never parsed; a real answer of that form still scores when written as the gold writes it. This keeps a step's
# verification time within a small multiple of its clean time whatever the policy writes (each tower would
# otherwise hold a worker for the whole timeout).
_BIG_FACTORIAL = re.compile(r"\d{5,}\s*!")
_MAX_DIGITS = 20000  # a power with more digits (999999^{999999}: 6 million) is not evaluated
_CLOSE = {"{": "}", "(": ")", "[": "]"}


def _group_end(s: str, i: int) -> int:
    """Index just past the group opening at s[i] (a bracket, matched with nesting), or past one token."""
    if s[i] in _CLOSE:
        depth, j = 0, i
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] in _CLOSE:
                depth += 1
            elif s[j] in _CLOSE.values():
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return len(s)
    m = re.match(r"\\?[\w.]+", s[i:])
    return i + (m.end() if m else 1)


def _group_start(s: str, end: int) -> int:
    """Index of the group closing just before s[end] (a bracket, matched with nesting), or of the number
    or word ending there."""
    i = end - 1
    while i >= 0 and s[i].isspace():
        i -= 1
    if i < 0:
        return 0
    opening = {v: k for k, v in _CLOSE.items()}
    if s[i] in opening:
        depth = 0
        while i >= 0:
            if s[i] in opening:
                depth += 1
            elif s[i] in _CLOSE:
                depth -= 1
                if depth == 0:
                    return i
            i -= 1
        return 0
    m = re.search(r"[\w.]+$", s[:i + 1])
    return m.start() if m else i


def _digits_of_power(base: str, exponent: str) -> float:
    """Decimal digits of base^exponent when both are plain numbers; otherwise the exponent's value (a
    symbolic or bracketed base is at least 2)."""
    try:
        e = float(exponent.strip("{}() "))
    except ValueError:
        return 0.0
    try:
        b = abs(float(base.strip("{}() ")))
    except ValueError:
        b = 2.0
    return e * math.log10(b) if b > 1 else 0.0


def too_costly(answer: str) -> bool:
    """True when parsing `answer` could make sympy compute a power tower, a power of more than
    `_MAX_DIGITS` digits, a factorial of a big or bracketed number, or a big binomial."""
    s = answer.replace("**", "^")
    if _BIG_FACTORIAL.search(s) or "\\uparrow" in s:
        return True
    if re.search(r"binom|choose", s) and re.search(r"\d{5,}", s):
        return True
    for i in (m.start() for m in re.finditer(r"!", s)):  # (10^{6})!: the factorial of a group
        if s[i + 1:i + 2] != "=" and i and s[i - 1] in ")}]":
            group = s[_group_start(s, i):i]
            if "^" in group or "!" in group or re.search(r"\d{4,}", group):
                return True
    for i in (m.start() for m in re.finditer(r"\^", s)):
        j = i + 1
        while j < len(s) and s[j].isspace():
            j += 1
        if j >= len(s):
            continue
        end = _group_end(s, j)
        exponent = s[j:end]
        rest = s[end:].lstrip()
        if "^" in exponent or rest.startswith("^") or re.search(r"\d{7,}", exponent):
            return True
        if _digits_of_power(s[_group_start(s, i):i], exponent) > _MAX_DIGITS:
            return True
    return False
