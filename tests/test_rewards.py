"""Verifiable rewards: math-verify in a process pool, format / exact-match rewards, registry."""

import time

import numpy as np
import pytest

from sage_jax.rewards import boxed, pool as pool_lib, verifiers as R


def B(s: str) -> str:
    return "Some working here. The final answer is $\\boxed{%s}$." % s


# (completion, gold, expected reward)
CASES = [
    # equivalent forms: fractions, decimals, \dfrac, \frac12
    (B("\\frac{1}{2}"), "0.5", 1.0),
    (B("0.5"), "\\frac12", 1.0),
    (B("\\dfrac{1}{2}"), "\\frac{1}{2}", 1.0),
    (B("\\tfrac{3}{4}"), "\\frac34", 1.0),
    (B("0.75"), "\\frac34", 1.0),
    (B("3/4"), "\\frac{3}{4}", 1.0),
    (B("\\frac{6}{8}"), "\\frac34", 1.0),
    (B("-\\frac{1}{3}"), "\\frac{-1}{3}", 1.0),
    # intervals and sets
    (B("(1,3]"), "(1,3]", 1.0),
    (B("(1, 3]"), "(1,3]", 1.0),
    (B("[1,3)"), "(1,3]", 0.0),
    (B("(-\\infty, 2)"), "(-\\infty,2)", 1.0),
    (B("\\{1,2,3\\}"), "\\{3,2,1\\}", 1.0),
    (B("\\{1,2\\}"), "\\{1,2,3\\}", 0.0),
    (B("1, 2, 3"), "3, 2, 1", 1.0),
    (B("\\left( 2, 3 \\right)"), "(2,3)", 1.0),
    # units, percent, degrees, money, thousands separators
    (B("10\\text{ cm}"), "10", 1.0),
    (B("10 \\mbox{ meters}"), "10", 1.0),
    (B("50\\%"), "50", 1.0),
    (B("50\\%"), "\\frac12", 1.0),
    (B("30^\\circ"), "30", 1.0),
    (B("\\$18.90"), "18.90", 1.0),
    (B("1{,}000"), "1000", 1.0),
    (B("1,000"), "1000", 1.0),
    # radicals, symbols, expressions, LaTeX spacing
    (B("\\sqrt{2}/2"), "\\frac{\\sqrt{2}}{2}", 1.0),
    (B("\\frac{\\sqrt 3}{3}"), "\\frac{1}{\\sqrt{3}}", 1.0),
    (B("2\\sqrt{2}"), "\\sqrt{8}", 1.0),
    (B("x = 5"), "5", 1.0),
    (B("\\pi"), "\\pi", 1.0),
    (B("2\\pi"), "2 \\pi", 1.0),
    (B("x^2+2x+1"), "(x+1)^2", 1.0),
    (B("  7  "), "7", 1.0),
    (B("\\, 7 \\;"), "7", 1.0),
    (B("A"), "A", 1.0),
    (B("\\text{(B)}"), "B", 1.0),
    # which answer counts: the last complete box; math-verify's own extraction without a box
    ("I think the answer is 42.", "42", 1.0),
    ("so $x = 12$ and finally \\boxed{12} but wait, \\boxed{14}", "14", 1.0),
    ("first \\boxed{12} then \\boxed{14}", "12", 0.0),
    ("\\boxed{\\boxed{9}}", "9", 1.0),
    # wrong answers
    (B("2"), "3", 0.0),
    (B("\\frac{1}{3}"), "0.5", 0.0),
    (B("0.333"), "\\frac{1}{3}", 0.0),
    (B("-5"), "5", 0.0),
    (B("(2,3)"), "(3,2)", 0.0),
    (B("x^2+1"), "(x+1)^2", 0.0),
    (B("10\\%"), "50", 0.0),
    # missing answers (and a missing gold)
    ("", "3", 0.0),
    ("I don't know.", "3", 0.0),
    ("The answer is \\boxed{}", "3", 0.0),
    ("truncated \\boxed{3", "3", 0.0),
    (B("3"), "", 0.0),
]


@pytest.fixture(scope="module")
def pool():
    with pool_lib.VerifierPool(num_workers=2, timeout_s=5.0) as p:
        yield p


def test_table_of_cases(pool):
    assert len(CASES) >= 40
    got, stats = pool.verify([c for c, _, _ in CASES], [g for _, g, _ in CASES])
    assert got.dtype == np.float32 and got.shape == (len(CASES),)
    wrong = [(c[-50:], g, e, float(x)) for (c, g, e), x in zip(CASES, got) if x != e]
    assert not wrong, wrong
    assert stats.timeouts == 0 and stats.errors == 0
    assert stats.correct == sum(e for _, _, e in CASES)
    assert stats.no_answer >= 4 and stats.gold_unparsed == 1


# A box that the reading window (the last MAX_COMPLETION_CHARS characters) cuts: the answer is read whole from the
# full text, or not at all, in every reward mode. (Before, a box opened before the window was read as an unboxed
# tail: `\boxed{1+1+...+1}` scored 1 for the gold 1.)
_LONG = 20000  # characters: more than the window


@pytest.mark.parametrize("reward", ["math_verify", "math_verify_text", "exact_match"])
def test_a_box_cut_by_the_reading_window_is_read_whole_or_not_at_all(pool, reward):
    def score(texts, golds):
        if reward == "exact_match":
            return R.exact_match_reward(texts, golds)
        return pool.verify(texts, golds, mode=R.VERIFIER_MODES[reward])[0]

    wrong = ["\\boxed{" + "1+" * _LONG + "1}",  # the case: its tail reads as 1
             "\\boxed{" + "2 + " * _LONG + "2}",  # a long wrong sum whose tail ends in the gold
             "\\boxed{" + "1+" * _LONG + "1"]  # a box cut by the window that never closes
    np.testing.assert_array_equal(score(wrong, ["1", "2", "1"]), [0.0, 0.0, 0.0])
    # a short correct box across the window's edge is found on the full text (no false negative)
    right = "x" * _LONG + " \\boxed{42} " + "y" * (pool_lib.MAX_COMPLETION_CHARS - 4)
    assert "\\boxed{" not in right[-pool_lib.MAX_COMPLETION_CHARS:]  # the window does cut it
    np.testing.assert_array_equal(score([right], ["42"]), [1.0])


def test_pathological_batch_returns_in_time_with_zeros():
    timeout = 1.5
    with pool_lib.VerifierPool(num_workers=2, timeout_s=timeout) as p:
        p.verify(["\\boxed{1}"], ["1"])  # start the workers outside the timed call
        bad = [
            "\\boxed{9^{9^{9^{9}}}}",  # sympy evaluates this power in C: only a kill stops it
            "\\boxed{10^{10^{10^{10}}}}",
            "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",  # deeply nested braces
            "x" * (1 << 20),  # 1 MB of text
            "\\boxed{3" + "{" * 100000,  # 100k unclosed braces
            "\ud800\\boxed{\udcff}\udfff",  # lone surrogates (invalid UTF-8)
            "",
        ]
        t0 = time.monotonic()
        got, stats = p.verify(bad, ["3"] * len(bad))
        elapsed = time.monotonic() - t0
        assert elapsed < 2 * timeout, elapsed
        np.testing.assert_array_equal(got, np.zeros(len(bad), np.float32))
        assert stats.rejected >= 2  # the towers never reach sympy (answer_cost.too_costly)
        # a gold is trusted and parsed: a tower there is stopped by the hard timeout, and the worker replaced
        t0 = time.monotonic()
        got, stats = p.verify(["\\boxed{3}"], ["9^{9^{9^{9}}}"])
        assert time.monotonic() - t0 < 2 * timeout and got[0] == 0.0
        assert stats.timeouts == 1 and p.restarts >= 1
        # The recycled workers still verify correctly.
        got, stats = p.verify(["\\boxed{3}", "\\boxed{4}"], ["3", "3"])
        np.testing.assert_array_equal(got, [1.0, 0.0])
        assert stats.timeouts == 0


COSTLY = ["(10^{6})!", "999999^{999999}", "\\binom{9999999}{4999999}", "10^{10^{10}}", "99999!", "3^{123456789}",
          "2^3^4", "{(2^{20})}!", "12345^{9999}"]
CHEAP = ["2^{10}", "10^{100}", "5!", "(3+4)!", "\\binom{10}{3}", "x^{2}", "2^{64}", "1.5 \\times 10^{33}", "e^{i\\pi}",
         "n!", "(2n)!", "3 != 4", "\\frac{10!}{3!7!}", "4.5 \\times 10^{-33}", "(1+x)^{2024}", "7^{1000}", "1000!",
         "(100)!"]


def test_too_costly_flags_unbounded_answers_and_passes_real_ones():
    from sage_jax.rewards.answer_cost import too_costly
    assert [a for a in COSTLY if not too_costly(a)] == []
    assert [a for a in CHEAP if too_costly(a)] == []


def test_text_mode_is_guarded_like_boxed_mode():
    """The official reward parses the whole completion: hostile text there is rejected, not parsed."""
    with pool_lib.VerifierPool(num_workers=2, timeout_s=2.0) as p:
        hostile = [f"so the answer is ${a}$" for a in COSTLY]
        t0 = time.monotonic()
        got, stats = p.verify(hostile, ["3"] * len(hostile), mode="text")
        assert time.monotonic() - t0 < 2.0 and not got.any()
        assert stats.rejected == len(hostile) and stats.timeouts == 0
        got, _ = p.verify(["so the answer is $7$", "we get $2^{10}$"], ["7", "1024"], mode="text")
        np.testing.assert_array_equal(got, [1.0, 1.0])


def test_hostile_text_costs_a_small_multiple_of_clean_text(pool):
    """Verification time of a batch of hostile completions (power towers in every spelling, thousands of
    unclosed boxes, megabytes of text) stays within a small multiple of a clean batch's: nothing reaches the
    parser that could hold a worker for the whole timeout."""
    clean = [f"Work ... so the answer is \\boxed{{{i}}}." for i in range(64)]
    towers = ["\\boxed{10^{10^{10}}}", "\\boxed{{9}^{{9}^{9}}}", "\\boxed{2^3^4^5}", "\\boxed{(9)^((9)^(9^9))}",
              "the answer is 9^{9^{9^9}}", "\\boxed{99999!}", "\\boxed{3^{123456789}}", "\\boxed{(10^{6})!}",
              "\\boxed{999999^{999999}}", "\\boxed{\\binom{9999999}{4999999}}"]
    hostile = [towers[i % len(towers)] for i in range(32)] + ["x \\boxed{" * 4000] * 16 + ["\\boxed{" + "{" * 20000] * 16
    pool.verify(clean[:4], [str(i) for i in range(4)])  # workers up
    t0 = time.monotonic()
    got_clean, _ = pool.verify(clean, [str(i) for i in range(64)])
    t_clean = time.monotonic() - t0
    t0 = time.monotonic()
    got, stats = pool.verify(hostile, ["3"] * 64)
    t_hostile = time.monotonic() - t0
    assert got_clean.all() and not got.any()
    assert stats.timeouts == 0 and stats.rejected >= 32
    assert t_hostile < 3 * t_clean + 1.0, (t_hostile, t_clean)
    # a tower that is the gold, written the same way, still scores
    got, _ = pool.verify(["\\boxed{2^{2^{10}}}", "\\boxed{2^{ 2^{10} }}", "\\boxed{4^{2^9}}"], ["2^{2^{10}}"] * 3)
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0])


def test_none_and_scalars_never_raise():
    assert R.math_verify_reward(None, None).shape == (0,)
    assert R.exact_match_reward(None, None).shape == (0,)
    np.testing.assert_array_equal(R.exact_match_reward("\\boxed{3}", "3"), [1.0])


def test_never_raises_on_odd_inputs(pool):
    comps = [None, b"\xff\xfe \\boxed{3}", 3, np.str_("\\boxed{3}"), "\\boxed{3}"]
    golds = ["3", "3", "3", "3", None]
    got, _ = pool.verify(comps, golds)
    np.testing.assert_array_equal(got, [0.0, 1.0, 1.0, 1.0, 0.0])
    # Mismatched lengths: zeros and an error count from the public function, not an exception.
    got, stats = R.math_verify_reward_with_stats(["\\boxed{1}"] * 2, ["1"], pool=pool)
    np.testing.assert_array_equal(got, [0.0, 0.0])
    assert stats.errors == 2


def test_default_pool_interface():
    got = R.math_verify_reward(["\\boxed{\\frac{1}{2}}", "\\boxed{2}", ""], ["0.5", "3", "1"],
                               timeout_s=5.0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0])
    assert pool_lib.default_pool() is pool_lib.default_pool()  # created once, reused
    assert R.math_verify_reward([], []).shape == (0,)


def test_last_boxed():
    assert boxed.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert boxed.last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert boxed.last_boxed("\\boxed{2} then \\boxed{3") == "2"  # unclosed last box
    assert boxed.last_boxed("\\fbox{5}") == "5"
    assert boxed.last_boxed("no box") is None
    assert boxed.last_boxed("\\boxed{}") == ""  # an empty box is a box, with no answer in it


def test_one_answer_reader_for_rewards_and_eval():
    """The verifier, the exact-match reward and the eval's majority vote read the same final answer,
    including the TeX short form and an escaped backslash before a brace."""
    from sage_jax.rewards.boxed import extract_boxed_answer

    texts = ["so $\\boxed 7$", "\\boxed{a\\\\{b}}", "\\boxed{ x  +  1 }", "\\boxedx{3}", "\\boxed{3} \\boxed{"]
    assert [boxed.last_boxed(t) for t in texts] == ["7", "a\\\\{b}", "x  +  1", None, "3"]
    assert [extract_boxed_answer(t) for t in texts] == ["7", "a\\\\{b}", "x + 1", None, "3"]
    np.testing.assert_array_equal(R.exact_match_reward(texts, ["7", "a\\\\{b}", "x+1", "3", "3"]), [1, 1, 1, 0, 1])


def test_format_reward():
    comps = ["x \\boxed{3}", "x \\boxed{}", "3", "<think>a</think> \\boxed{3}",
             "a</think> so \\boxed{3}", "<think>a \\boxed{3}</think>", "</think><think>\\boxed{1}"]
    np.testing.assert_array_equal(R.format_reward(comps), [1, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(R.format_reward(comps, wrapper="think"), [0, 0, 0, 1, 1, 0, 0])


def test_exact_match_reward():
    comps = ["= 6. \\boxed{6}", "\\boxed{-05}", "\\boxed{ 1/2 }", "\\boxed{7}", "6", "\\boxed{x+1}"]
    golds = ["6", "-5", "0.5", "6", "6", "x + 1"]
    np.testing.assert_array_equal(R.exact_match_reward(comps, golds), [1, 1, 1, 0, 0, 1])


def test_registry_weights_and_errors(pool):
    assert R.parse_reward_spec("math_verify:1.0, format:0.1") == {"math_verify": 1.0, "format": 0.1}
    assert R.parse_reward_spec(["exact_match"]) == {"exact_match": 1.0}
    assert R.parse_reward_spec({"think_format": 2}) == {"think_format": 2.0}
    with pytest.raises(ValueError, match="unknown reward"):
        R.parse_reward_spec("math_verfy")
    comps, golds = ["\\boxed{6}", "\\boxed{5}", "no idea"], ["6", "6", "6"]
    total, parts, stats = R.compute_rewards(comps, golds, {"math_verify": 1.0, "format": 0.5},
                                            pool=pool)
    np.testing.assert_allclose(total, [1.5, 0.5, 0.0])
    np.testing.assert_array_equal(parts["math_verify"], [1, 0, 0])
    assert stats.n == 3 and stats.correct == 1
    fn = R.make_reward_fn("exact_match:2")
    np.testing.assert_array_equal(fn(comps, golds), [2.0, 0.0, 0.0])


def test_workers_do_not_rerun_the_main_script(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "train_without_main_guard.py"
    script.write_text(
        "print('MAIN STARTED', flush=True)\n"
        "from sage_jax.rewards.verifiers import VerifierPool\n"
        "p = VerifierPool(num_workers=2, timeout_s=5.0)\n"
        "print('REWARDS', p.verify(['\\\\boxed{2}', '\\\\boxed{3}'], ['2', '2'])[0].tolist())\n"
        "p.close()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env).stdout
    assert out.count("MAIN STARTED") == 1, out
    assert "REWARDS [1.0, 0.0]" in out, out


def test_a_crashed_worker_fails_its_sample_closed_and_is_replaced():
    import os
    import signal
    import threading

    with pool_lib.VerifierPool(num_workers=1, timeout_s=30.0) as p:
        p.verify(["\\boxed{1}"], ["1"])
        out = {}
        t = threading.Thread(target=lambda: out.update(
            r=p.verify(["\\boxed{3}", "\\boxed{3}"], ["9^{9^{9^{9}}}", "3"])))  # the gold holds it: it is parsed
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        os.kill(p._workers[0].proc.pid, signal.SIGKILL)  # dies mid-sample, like a segfault
        t.join(timeout=20)
        got, stats = out["r"]
        assert time.monotonic() - t0 < 10  # noticed at once, not at the 30 s timeout
        np.testing.assert_array_equal(got, [0.0, 1.0])
        assert stats.errors == 1 and stats.timeouts == 0 and p.restarts == 1


def _official_reward(txt: str, gt: str) -> int:
    """The official SAGE reward as its source writes it (tally0818/SAGE src/train/rewards.py)."""
    try:
        from math_verify import parse, verify
        return int(verify(parse(gt), parse(txt)))
    except Exception:  # noqa: BLE001
        return 0


def test_text_mode_is_the_official_reward(pool):
    """math_verify_text scores like the official code, which differs from the boxed reader where the text
    has no box, several answers, or a gold math-verify cannot read bare."""
    comps = ["<start_working_out>2+2<end_working_out><SOLUTION>4</SOLUTION>",
             "so x = 3. <SOLUTION>\\frac{1}{2}</SOLUTION>", "<SOLUTION>0.5</SOLUTION>",
             "The answer is $\\boxed{12}$ and not 13", "no number here", "<SOLUTION>3, 4</SOLUTION>",
             "<SOLUTION>\\sqrt{2}</SOLUTION>", "<SOLUTION>10</SOLUTION>"]
    golds = ["4", "1/2", "\\frac{1}{2}", "12", "7", "4", "\\sqrt{2}", "10.0"]
    want = np.array([_official_reward(c, g) for c, g in zip(comps, golds)], np.float32)
    got, stats = pool.verify(comps, golds, mode="text")
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < len(want) and stats.n == len(comps)
    np.testing.assert_array_equal(R.math_verify_text_reward(comps, golds, pool=pool), want)
    assert R.parse_reward_spec("math_verify_text") == {"math_verify_text": 1.0}
    with pytest.raises(ValueError, match="mode"):
        pool.verify(comps, golds, mode="last_line")


def test_scientific_notation_golds(pool):
    """Minerva's e-notation golds: math-verify alone reads `$4.5e33$` as 4.5*e*33 and fails a right answer."""
    from math_verify import parse, verify
    assert not verify(parse("$4.5e33$"), parse("$4.5 \\times 10^{33}$"))  # the defect being fixed
    comps = ["\\boxed{4.5 \\times 10^{33}}", "\\boxed{4.5e33}", "\\boxed{4.6 \\times 10^{33}}", "\\boxed{0.0022}",
             "\\boxed{2.2 \\times 10^{3}}", "\\boxed{3e8}"]
    golds = ["4.5e33", "4.5e33", "4.5e33", "2.2e-3", "2.2e-3", "3 \\times 10^8"]
    got, _ = pool.verify(comps, golds)
    np.testing.assert_array_equal(got, [1, 1, 0, 1, 0, 1])
