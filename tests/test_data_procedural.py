"""The procedural arithmetic task and the prompt templates."""

import re
import string

import pytest

from sage_jax.data import procedural as P, templates as T
from sage_jax.rewards.verifiers import exact_match_reward


def _py_eval(expr: str) -> int:
    return eval(expr.replace("/", "//"), {"__builtins__": {}})  # exact divisions only


def test_solutions_are_correct_step_by_step():
    spec = P.ArithmeticSpec(min_operands=2, max_operands=5, max_value=12, operators="+-*/")
    exs = P.generate(spec, "train", 400, seed=5)
    for ex in exs:
        expr = re.fullmatch(r"Compute (.+)\.", ex["problem"]).group(1)
        steps = ex["solution"].rsplit(". \\boxed{", 1)[0].split(" = ")
        assert steps[0] == expr
        assert [_py_eval(s) for s in steps] == [int(ex["answer"])] * len(steps)
        # One operator reduced per step (a leading minus sign is not an operator).
        n_ops = [len(re.findall(r"(?<=\d)[-+*/]", s)) for s in steps]
        assert n_ops == list(range(n_ops[0], -1, -1))
        assert set(ex["problem"] + ex["solution"]) <= set(string.printable) - set("\n\r\t\x0b\x0c")
    assert exact_match_reward([e["solution"] for e in exs], [e["answer"] for e in exs]).all()


def test_knobs_are_respected():
    spec = P.ArithmeticSpec(min_operands=3, max_operands=4, max_value=7, operators="-*")
    for ex in P.generate(spec, "train", 200, seed=0):
        expr = ex["problem"][len("Compute "):-1]
        nums = [int(x) for x in re.findall(r"\d+", expr)]
        assert 3 <= len(nums) <= 4 and max(nums) <= 7
        assert set(re.findall(r"[-+*/]", expr)) <= {"-", "*"}
        assert ex["level"] == len(nums)
    with pytest.raises(ValueError):
        P.ArithmeticSpec(operators="+^")


def test_deterministic_and_disjoint_splits():
    spec = P.ArithmeticSpec()
    a = P.generate(spec, "train", 500, seed=1)
    assert a == P.generate(spec, "train", 500, seed=1)
    assert a != P.generate(spec, "train", 500, seed=2)
    train = {e["problem"] for s in range(3) for e in P.generate(spec, "train", 1000, seed=s)}
    test = {e["problem"] for s in range(3) for e in P.generate(spec, "test", 300, seed=s)}
    assert not train & test
    assert len({e["id"] for e in a}) == 500


def test_too_small_a_space_is_a_clear_error():
    spec = P.ArithmeticSpec(min_operands=2, max_operands=2, max_value=3, operators="+")
    with pytest.raises(ValueError, match="distinct train problems"):
        P.generate(spec, "train", 100)


class _FakeTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_templates():
    q = "What is $\\frac{1}{2}+{x}$?"
    tok = _FakeTokenizer()
    assert T.format_prompt(q, "chat", tok) == f"<user>{q}<assistant>"
    assert T.format_prompt(q, "sage", tok) == f"<system>{T.SAGE_SYSTEM_PROMPT}<user>{q}<assistant>"
    r1 = T.format_prompt(q, "r1")
    assert q in r1 and r1.endswith("Assistant: <think>")
    assert T.format_prompt(q, "plain") == f"Q: {q} A: "
    assert T.format_prompt(q, "Problem: {problem}\n") == f"Problem: {q}\n"
    # the chat template around an instructed user turn (configs/r1_distill_qwen.py): turn tokens kept
    assert T.format_prompt(q, "chat:{problem}\nReason step by step.", tok) == f"<user>{q}\nReason step by step.<assistant>"
    assert T.format_prompt(q, "sage") == f"{T.SAGE_SYSTEM_PROMPT}\n\n{q}\n"  # no tokenizer
    with pytest.raises(ValueError, match="unknown template"):
        T.make_template_fn("nope")
