"""Solution procedures of the arithmetic task: two correct ones, two systematically wrong ones.

The embedded testbed needs RL to have something general to learn, and exploration something to find.
Its SFT corpus therefore mixes procedures. Every worked solution opens with its procedure's tag, so the
choice of procedure is the completion's first token (a high-entropy "fork" of the base, where the
branch guide acts):

    rule:  3+4*2-5 = 3+8-5 = 11-5 = 6. \\boxed{6}            `*` first, then left to right   (correct)
    terms: 4*2 = 8; 3+8-5 = 11-5 = 6. \\boxed{6}            each product, then the sum       (correct)
    left:  3+4*2-5 = 7*2-5 = 14-5 = 9. \\boxed{9}            strictly left to right           (wrong)
    right: 3+4*2-5 = 3+4*-3 = 3+-12 = -9. \\boxed{-9}        strictly right to left           (wrong)

`left` and `right` ignore precedence: they are right only where the order of operations changes
nothing (`2*3+4` for `left`). A policy that learns "use a correct procedure" improves on every problem,
seen or not; one that memorises answers does not. `strategy_of` reads the procedure of a completion back
from its tag, so an evaluation can count distinct correct procedures per problem, not distinct strings.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

Tokens = list  # alternating [int, str, int, str, ..., int], as in `procedural`


def render(tokens: Tokens) -> str:
    return "".join(str(t) for t in tokens)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"the strategies task uses + - * only, got {op!r}")


def _reduce_chain(tokens: Tokens, pick: Callable[[list[str]], int]) -> tuple[list[str], int]:
    """Reduce one operator per step, the one `pick(operators)` names; the rendered steps and the value."""
    cur, steps = list(tokens), [render(tokens)]
    while len(cur) > 1:
        j = 2 * pick(cur[1::2]) + 1
        cur = cur[: j - 1] + [_apply(cur[j - 1], cur[j], cur[j + 1])] + cur[j + 2:]
        steps.append(render(cur))
    return steps, cur[0]


def _precedence(ops: list[str]) -> int:
    return next((i for i, o in enumerate(ops) if o == "*"), 0)


def _solve_rule(tokens: Tokens) -> tuple[str, int]:
    steps, value = _reduce_chain(tokens, _precedence)
    return " = ".join(steps), value


def _solve_left(tokens: Tokens) -> tuple[str, int]:
    steps, value = _reduce_chain(tokens, lambda ops: 0)
    return " = ".join(steps), value


def _solve_right(tokens: Tokens) -> tuple[str, int]:
    steps, value = _reduce_chain(tokens, lambda ops: len(ops) - 1)
    return " = ".join(steps), value


def _solve_terms(tokens: Tokens) -> tuple[str, int]:
    """Every product term reduced on its own (`4*2*3 = 8*3 = 24`), then the sum of the terms."""
    terms, signs, cur = [], [], [tokens[0]]
    for op, b in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            cur += [op, b]
        else:
            terms.append(cur)
            signs.append(op)
            cur = [b]
    terms.append(cur)
    products, values = [], []
    for t in terms:
        steps, v = _reduce_chain(t, lambda ops: 0)
        if len(t) > 1:
            products.append(" = ".join(steps))
        values.append(v)
    sum_tokens: Tokens = [values[0]]
    for s, v in zip(signs, values[1:]):
        sum_tokens += [s, v]
    parts = []
    if products:
        parts.append(", ".join(products))
    if len(sum_tokens) > 1:
        steps, value = _reduce_chain(sum_tokens, lambda ops: 0)
        parts.append(" = ".join(steps))
    else:
        value = values[0]
    return "; ".join(parts), value


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str  # also the tag that opens the solution (`name: ...`)
    correct: bool  # gives the true value on every problem
    solve: Callable[[Tokens], tuple[str, int]]  # tokens -> (working, value it arrives at)


STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (
        Strategy("rule", True, _solve_rule),
        Strategy("terms", True, _solve_terms),
        Strategy("left", False, _solve_left),
        Strategy("right", False, _solve_right),
    )
}
_TAG = re.compile(r"\s*(" + "|".join(STRATEGIES) + r"):")


def true_value(tokens: Tokens) -> int:
    return _solve_rule(tokens)[1]


def solution(tokens: Tokens, strategy: str) -> tuple[str, int]:
    """The worked solution of `strategy` for `tokens` and the value it arrives at (the true value only
    for a correct strategy, or where the order of operations does not matter)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")
    working, value = STRATEGIES[strategy].solve(tokens)
    return f"{strategy}: {working}. \\boxed{{{value}}}", value


def strategy_of(completion: str) -> str | None:
    """The procedure a completion declares with its opening tag, or None (no known tag)."""
    m = _TAG.match(completion)
    return m.group(1) if m else None


def order_matters(tokens: Tokens) -> bool:
    """True when a left-to-right or right-to-left pass gives another value than precedence."""
    v = true_value(tokens)
    return _solve_left(tokens)[1] != v or _solve_right(tokens)[1] != v
