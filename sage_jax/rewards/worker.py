"""What runs inside one verifier worker process (`sage_jax.rewards.pool` starts, times and replaces them):
math-verify on one (completion, gold) pair at a time, in `boxed` mode (the last `\\boxed{}` of the
completion against the gold) or `text` mode (the official SAGE reward: math-verify reads the whole text)."""

from __future__ import annotations

import logging
import multiprocessing.connection as mp_connection
import re
import signal

from sage_jax.rewards.answer_cost import too_costly
from sage_jax.rewards.boxed import has_box, last_boxed

# Only the tail of a completion is verified: the final answer sits at the end, and the regexes
# and parsers downstream are super-linear on pathological megabyte strings.
MAX_COMPLETION_CHARS = 16384
# A boxed answer (or a gold answer) longer than this is not a real answer; fail closed.
MAX_ANSWER_CHARS = 1024
DEFAULT_TIMEOUT_S = 5.0
# Without a box, math-verify's own extraction reads the text: only its tail, where a stated answer sits.
MAX_UNBOXED_CHARS = 2048


_SCI = re.compile(r"^\s*\$?\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*[eE]\s*([-+]?\d+)\s*\$?\s*$")


def sci_to_latex(answer: str) -> str:
    """`4.5e33` -> `4.5 \\times 10^{33}`: math-verify reads a bare e-notation literal as 4.5 * e * 33
    (Minerva has 58 such golds of 272), so both sides are normalised before verifying. Other text unchanged."""
    m = _SCI.match(answer)
    return f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}" if m else answer


def _gold_candidates(gold: str) -> list[str]:
    """Strings to try for the gold answer, in order (docs/design.md §7: bare golds need `$...$`)."""
    boxed = last_boxed(gold) if "box" in gold else None
    core = sci_to_latex(boxed if boxed is not None else gold.strip())
    cands = [f"${core.strip('$').strip()}$"]
    if core != gold:
        cands.append(gold)
    return cands


MODES = ("boxed", "text")


def _verify_text(completion: str, gold: str, cache: dict) -> tuple[float, str]:
    """The official SAGE reward (tally0818/SAGE src/train/rewards.py): `verify(parse(gold), parse(text))`
    on the whole completion and the gold string as given, 0 on any exception (here: status error:...,
    raised to the caller's handler). math-verify's own extraction picks the answer from the text."""
    from math_verify import parse, verify

    if too_costly(completion):  # the guard of boxed mode, on the whole text math-verify will read
        return 0.0, "rejected"
    key = ("text", gold)
    if key not in cache:
        if len(cache) > 4096:
            cache.clear()
        cache[key] = parse(gold, parsing_timeout=None)
    gold_parsed = cache[key]
    if not gold_parsed:
        return 0.0, "gold_unparsed"
    pred = parse(completion, parsing_timeout=None)
    if not pred:
        return 0.0, "no_answer"
    return (1.0 if verify(gold_parsed, pred, timeout_seconds=None) else 0.0), "ok"


def _verify_one(completion: str, gold: str, cache: dict, mode: str = "boxed") -> tuple[float, str]:
    """Score one sample inside a worker. Returns (reward, status)."""
    from math_verify import parse, verify  # imported once per worker (preloaded).

    if mode == "text":
        return _verify_text(completion, gold, cache)
    if len(gold) > MAX_ANSWER_CHARS:
        return 0.0, "gold_unparsed"
    gold_parsed = cache.get(gold)
    if gold_parsed is None:
        gold_parsed = []
        for cand in _gold_candidates(gold):
            gold_parsed = parse(cand, parsing_timeout=None)
            if gold_parsed:
                break
        if len(cache) > 4096:
            cache.clear()
        cache[gold] = gold_parsed
    if not gold_parsed:
        return 0.0, "gold_unparsed"

    boxed = last_boxed(completion)
    if boxed is not None:
        if not boxed or len(boxed) > MAX_ANSWER_CHARS:
            return 0.0, "no_answer"
        if too_costly(boxed):
            same = "".join(boxed.split()) == "".join(gold.strip().strip("$").split())
            return (1.0 if same else 0.0), "ok" if same else "rejected"
        pred = parse(f"${sci_to_latex(boxed)}$", parsing_timeout=None)
    elif has_box(completion):  # a box opened that never closes (a cut answer): no answer, never its tail read
        return 0.0, "no_answer"
    else:
        # No box: math-verify's own extraction ("the answer is ...", last LaTeX / expression).
        tail = completion[-MAX_UNBOXED_CHARS:]
        if too_costly(tail):
            return 0.0, "rejected"
        pred = parse(tail, parsing_timeout=None)
    if not pred:
        return 0.0, "no_answer"
    return (1.0 if verify(gold_parsed, pred, timeout_seconds=None) else 0.0), "ok"


def worker_main(conn: mp_connection.Connection) -> None:
    """Worker loop: receive (task_id, completion, gold), reply (task_id, reward, status)."""
    # math-verify warns on every call that its signal timeout is off; the parent enforces time.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401  (fail early, before reporting ready)

    # Ctrl-C is for the parent; a worker leaves when its pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    cache: dict = {}
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if msg is None:
            return
        task_id, completion, gold, mode = msg
        try:
            reward, status = _verify_one(completion, gold, cache, mode)
        except BaseException as e:  # noqa: BLE001  (RecursionError, sympy internals, ...)
            reward, status = 0.0, f"error:{type(e).__name__}"
        try:
            conn.send((task_id, reward, status))
        except (EOFError, OSError):
            return
