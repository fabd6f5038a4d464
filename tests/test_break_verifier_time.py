"""Verifiers in linear time (issue 33, cause 4): no completion can make scoring burn its time limit.

A regex audit. Every pattern reward.py compiles (AUDIT must name each: a new one fails
test_every_verifier_pattern_is_audited until it is), the patterns that read a judge's reply or a data file, and
the functions that parse a completion around them, run on crafted inputs: repetitions of the characters their
quantifiers overlap on, and near-misses that fail at the last character, where a backtracking engine tries
every split first. At lengths 10, 100, 1,000 and 10,000 the work must grow about linearly: each tenfold
length costs at most GROWTH times more CPU (linear: ~10; quadratic: ~100; exponential: the time limit). A ratio
of CPU times on one machine, with a generous factor, not a wall-clock bound: it holds on a slow machine or a busy
one. Before the fix reward.PROSE_RE took 0.7 s on 24 characters and ran past the limit on 100 (exponential), and
the <answer> regex and unbox grew quadratically.
"""

import math
import re
import time

import pytest

import data
import reward
import reward_model
from scoring import ScoreTimeout, time_limited

LENGTHS = (10, 100, 1_000, 10_000)
GROWTH = 30  # at most this much more CPU for ten times the length: 3x linear's 10, well under quadratic's 100
MIN_CPU_S = 0.01  # a measurement repeats its call until it has this much CPU time (a short one alone is noise)
CALL_LIMIT_S = 2.0  # one measurement past this has blown up (an exponential pattern at 100 characters)


class Code:  # the fields of a HumanEval problem reward.code_solution reads
    prompt, entry_point = "def f(x):\n", "f"


def times(n: int, unit: str) -> str:
    """unit repeated to about n characters (at least once)."""
    return unit * max(1, n // len(unit))


def case(fn, make, id):
    return pytest.param(fn, make, id=id)


# (what runs, the input of length ~n): for each pattern, the repeats its quantifiers overlap on and near-misses
AUDIT = {
    "PROSE_RE": [
        case(reward.PROSE_RE.fullmatch, lambda n: times(n, "a") + "(", id="prose: a run of a's, then a bracket"),
        case(reward.PROSE_RE.fullmatch, lambda n: times(n, "aI") + "2", id="prose: words and single letters"),
        case(reward.PROSE_RE.fullmatch, lambda n: times(n, "a ") + "(", id="prose: letters and spaces"),
    ],
    "NUMBER_RE": [
        case(reward.NUMBER_RE.findall, lambda n: times(n, "1") + "a", id="number: digits, then a letter"),
        case(reward.NUMBER_RE.findall, lambda n: "1" + times(n, ",111") + "a", id="number: thousands, then a letter"),
        case(reward.NUMBER_RE.findall, lambda n: times(n, "1.") + "a", id="number: dots"),
        case(reward.NUMBER_RE.findall, lambda n: times(n, "-1,1"), id="number: signs and commas"),
    ],
    "PLAIN_NUMBER_RE": [
        case(reward.PLAIN_NUMBER_RE.fullmatch, lambda n: times(n, "1") + ".1a", id="plain number: a letter last"),
    ],
    "CODE_BLOCK_RE": [
        case(reward.CODE_BLOCK_RE.findall, lambda n: times(n, "```py\n"), id="code: fences only"),
        case(reward.CODE_BLOCK_RE.findall, lambda n: "```\n" + times(n, "``x"), id="code: an open fence"),
        case(reward.CODE_BLOCK_RE.findall, lambda n: times(n, "```pytho"), id="code: near-miss tags"),
    ],
    "BRACE_RE": [case(lambda s: list(reward.BRACE_RE.finditer(s)), lambda n: times(n, "{"), id="braces")],
    "RELATION_RE": [
        case(reward.RELATION_RE.findall, lambda n: times(n, "<="), id="relation: no relation"),
        case(reward.RELATION_RE.findall, lambda n: times(n, "\\equi"), id="relation: near-miss commands"),
    ],
    "OR_RE": [
        case(reward.OR_RE.findall, lambda n: times(n, "\\lo"), id="or: near-miss commands"),
        case(reward.OR_RE.findall, lambda n: times(n, "oro"), id="or: inside words"),
    ],
    "DIGIT_SUBSCRIPT_RE": [
        case(reward.DIGIT_SUBSCRIPT_RE.search, lambda n: "1}" + times(n, " "), id="digit subscript: spaces"),
        case(reward.DIGIT_SUBSCRIPT_RE.search, lambda n: times(n, "1 "), id="digit subscript: digits and spaces"),
    ],
    "TEXT_RE": [
        case(reward.TEXT_RE.search, lambda n: "\\text" + times(n // 2, "a") + times(n // 2, " "), id="text: no brace"),
        case(reward.TEXT_RE.search, lambda n: times(n, "\\textt "), id="text: near-misses"),
    ],
    "SUBSCRIPT_RE": [
        case(lambda s: reward.SUBSCRIPT_RE.sub("", s), lambda n: "_{" + times(n, "a"), id="subscript: unclosed"),
        case(lambda s: reward.SUBSCRIPT_RE.sub("", s), lambda n: times(n, "_{a"), id="subscript: many unclosed"),
    ],
    "CONSTANT_RE": [
        case(reward.CONSTANT_RE.fullmatch, lambda n: times(n, " ") + "x", id="constant: spaces"),
        case(reward.CONSTANT_RE.fullmatch, lambda n: times(n // 2, " ") + "\\pi" + times(n // 2, " ") + "x",
             id="constant: spaces around it, then a letter"),
    ],
}
PARSERS = [  # the functions that read a completion (or a gold) around those patterns
    # (looked up at the call: the tags were a regex before, reward.ANSWER_RE)
    case(lambda s: reward.answer_spans(s), lambda n: times(n, "<answer>"), id="answer tags: none closed"),
    case(lambda s: reward.answer_spans(s), lambda n: times(n, "<answer></answe"), id="answer tags: near-miss closing"),
    case(reward.unbox, lambda n: times(n // 2, "\\boxed{") + times(n // 2, "}"), id="unbox: nested boxes"),
    case(reward.outer_boxes, lambda n: times(n, "\\boxed{"), id="outer boxes: none closed"),
    case(lambda s: reward.final_answer(s, "1"), lambda n: times(n // 2, "\\boxed{") + times(n // 2, "}"),
         id="final answer: nested boxes"),
    case(lambda s: reward.final_answer(s, "1"), lambda n: times(n, "<answer>\\boxed{"), id="final answer: open tags"),
    case(lambda s: reward.several_values(s, "1"), lambda n: times(n, "\\text{1"), id="several values: open texts"),
    case(lambda s: reward.several_values(s, "1"), lambda n: times(n, "x = 1 or 2_"), id="several values: each rule"),
    case(reward.extract_answer, lambda n: times(n, "####"), id="extract answer: hashes"),
    case(reward.last_boxed, lambda n: "\\boxed{" + times(n, "{}{"), id="last box: unclosed"),
    case(lambda s: reward.code_solution(s, Code), lambda n: "def f" + times(n, " \n"), id="code: a def, no bracket"),
    case(reward_model.VERDICT_RE.search, lambda n: times(n, "Verdict: "), id="judge reply: verdicts without one"),
    case(data.CHECK_RE.search, lambda n: "def check" + times(n, " "), id="HumanEval test: no bracket"),
]


def cpu_per_call(fn, text: str) -> float:
    """CPU seconds one call of fn(text) takes: the least of 3 measurements, each repeating the call for MIN_CPU_S."""
    best = math.inf
    for _ in range(3):
        calls, start = 0, time.process_time()
        while (spent := time.process_time() - start) < MIN_CPU_S:
            fn(text)
            calls += 1
        best = min(best, spent / calls)
    return best


def assert_linear(fn, make):
    costs = {}
    for n in LENGTHS:
        text = make(n)
        assert n / 2 <= len(text) <= 2 * n + 20, (n, len(text))  # the input is the length it claims
        try:
            costs[n] = time_limited(cpu_per_call, fn, text, seconds=CALL_LIMIT_S)
        except ScoreTimeout:
            pytest.fail(f"{len(text)} characters: past {CALL_LIMIT_S} s (after {costs}): not linear")
    for short, long in zip(LENGTHS, LENGTHS[1:]):
        assert costs[long] <= GROWTH * costs[short], f"{short} -> {long} characters: CPU x" \
            f"{costs[long] / costs[short]:.0f}, more than x{GROWTH} ({costs})"


@pytest.mark.parametrize("fn, make", [c for cases in AUDIT.values() for c in cases])
def test_each_verifier_pattern_runs_in_linear_time(fn, make):
    assert_linear(fn, make)


@pytest.mark.parametrize("fn, make", PARSERS)
def test_each_parser_of_a_completion_runs_in_linear_time(fn, make):
    assert_linear(fn, make)


def test_every_verifier_pattern_is_audited():
    """A pattern reward.py compiles, now or later, has its crafted inputs in AUDIT."""
    compiled = {name for name, value in vars(reward).items() if isinstance(value, re.Pattern)}
    assert compiled == set(AUDIT)


def test_a_deeply_nested_box_is_read_not_a_recursion_error():
    """Boxes 2,000 deep (a degenerate completion): unwrapped, where box-by-box recursion stopped at Python's limit."""
    assert reward.unbox("\\boxed{" * 2000 + "7" + "}" * 2000) == "7"
    assert reward.final_answer("\\boxed{" * 2000 + "7" + "}" * 2000, "7") == "7"
