"""Verifiers, penalties, the advantage-inversion guard and overlapped scoring."""

import json
import math
import os
import re
import signal
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reward
import scoring
from data import CodeTask, load_task
from espo import group_advantages
from reward import RewardConfig, code_reward, extract_answer, math_reward
from shaping import adjust_rewards, judge_score, overlong_penalty, repetition_penalty, rm_score, shaped_rewards
from reward_model import StubJudge, StubRewardModel, stand_in_scorer
from scoring import RewardPool, ScoreTimeout, score_inline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("EVERYPROMPT_DATA", os.path.join(REPO, "..", "shared", "data"))
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason=f"real datasets not found at {DATA} (EVERYPROMPT_DATA)")


# ----------------------------------------------------------------------------- math

def test_extract_answer_prefers_answer_tags_then_boxed_then_hashes():
    assert extract_answer("<answer>1</answer> \\boxed{2} #### 3") == "1"
    assert extract_answer("so \\boxed{\\frac{1}{2}} and finally \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("work\n#### 1,600\nbye") == "1,600"
    assert extract_answer("\\boxed{unclosed") is None and extract_answer("no answer") is None


def test_math_reward_accepts_equivalent_forms_and_rejects_others():
    assert math_reward("<answer>$18</answer>", "18") == 1.0  # a currency sign
    assert math_reward("<answer>18 eggs</answer>", "18") == 1.0
    assert math_reward("thus $\\boxed{\\frac12}$", "0.5") == 1.0
    assert math_reward("<answer>19</answer>", "18") == 0.0
    assert math_reward("18", "18") == 0.0  # no delimited answer at all


def perturb(answer: str) -> str:
    """A wrong answer of the same shape: the first digit + 1 (mod 10), else a changed word or a + 1."""
    if d := re.search(r"\d", answer):
        return answer[:d.start()] + str((int(d.group()) + 1) % 10) + answer[d.end():]
    if "\\text{" in answer:
        return answer.replace("\\text{", "\\text{Z", 1)
    return answer + " + 1"


def raw_golds(path: str) -> list[str]:
    """Gold answers as the file writes them (GSM8K's '#### 1,600' keeps its comma)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r["answer"] if "problem" in r else r["answer"].rsplit("####", 1)[1].strip() for r in rows]


def check_gold_answers(name: str, size: int | None):
    path = os.path.join(DATA, name)
    task = load_task(path, size=size)
    golds = raw_golds(path)[:size]
    assert len(task) == len(golds) and task.skipped == []
    forms = [lambda g: f"Let me work it out.\n<answer>{g}</answer>", lambda g: f"So the answer is $\\boxed{{{g}}}$."]
    for form in forms:
        right = sum(task.score(form(g), it) for g, it in zip(golds, task.items))
        assert right >= 0.995 * len(task), (name, right)
    wrong = sum(task.score(f"<answer>{perturb(g)}</answer>", it) for g, it in zip(golds, task.items))
    assert wrong <= 0.005 * len(task), (name, wrong)


@needs_data
@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "math500_test.jsonl"])
def test_gold_answers_written_as_a_model_would_are_graded_correct_and_perturbed_ones_wrong(name):
    check_gold_answers(name, size=100)


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "math500_test.jsonl"])
def test_every_gold_answer_of_the_real_test_sets_is_graded_correct(name):
    check_gold_answers(name, size=None)


# An answer that lists candidates earns nothing, whichever of them is the gold.
LISTS = ["\\boxed{3, 4, 5}", "\\boxed{\\{3, 4, 5\\}}", "\\boxed{[3, 5]}", "\\boxed{(3, 5)}", "\\boxed{4 \\pm 1}",
         "\\boxed{3 \\text{ or } 4}", "\\boxed{3 \\lor 4}", "\\boxed{3 | 4}", "\\boxed{x = 3 \\text{ or } x = 4}",
         "\\boxed{\\begin{cases} 3 \\\\ 4 \\end{cases}}", "\\boxed{3;4}", "<answer>3 or 4</answer>",
         "<answer>3, 4</answer>", "<answer>the answer is 3 or 4</answer>", "<answer>$3$ or $4$</answer>",
         "<answer>3 4 5 eggs</answer>", "<answer>between 3 and 5</answer>"]


@pytest.mark.parametrize("completion", LISTS)
@pytest.mark.parametrize("gold", ["3", "4", "5"])
def test_an_answer_listing_candidates_earns_nothing_for_the_one_that_is_right(completion, gold):
    assert math_reward(completion, gold) == 0.0


def test_several_different_boxed_answers_earn_nothing():  # one answer, one value (reward.final_answer)
    assert math_reward("\\boxed{3} no, \\boxed{4}", "4") == 0.0
    assert math_reward("\\boxed{4} no, \\boxed{3}", "4") == 0.0
    assert math_reward("<answer>\\boxed{4} or \\boxed{3}</answer>", "4") == 0.0
    assert math_reward("<answer>\\boxed{3} or \\boxed{4}</answer>", "4") == 0.0
    assert math_reward("draft \\boxed{3}, then <answer>\\boxed{4}</answer>", "4") == 1.0  # the last span holds one


@pytest.mark.parametrize("answer, gold", [("(1, 2)", "(1,2)"), ("\\{1, 2\\}", "\\{1,2\\}"), ("1, 2", "1, 2"),
                                          ("2, 1", "1, 2"), ("[3,5]", "[3, 5]"),
                                          ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)")])
def test_a_gold_that_is_a_set_tuple_or_interval_still_matches_its_own_answer(answer, gold):
    assert math_reward(f"\\boxed{{{answer}}}", gold) == 1.0


@pytest.mark.parametrize("answer, reward_", [("18 eggs", 1.0), ("The answer is 18.", 1.0), ("$18", 1.0),
                                             ("18 eggs, 9 each day", 0.0), ("18x", 0.0), ("18 x", 0.0),
                                             ("18\\pi", 0.0), ("x-18", 0.0), ("18 or 19 eggs", 0.0)])
def test_the_plain_text_reading_takes_one_number_in_words_only(answer, reward_):
    assert math_reward(f"<answer>{answer}</answer>", "18") == reward_


# ----------------------------------------------------------------------------- code

ADD = CodeTask("toy/0", 'def add(a, b):\n    """Return a + b."""\n',
               "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add")


@pytest.mark.parametrize("completion", [
    "    return a + b\n",  # the body, continuing the prompt (HumanEval's convention)
    "def add(a, b):\n    return b + a\n",
    "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```",
])
def test_code_reward_runs_humaneval_format_tasks(completion):
    assert code_reward(completion, ADD) == 1.0


@pytest.mark.parametrize("completion", ["    return a - b\n", "    return a +\n", "    import sys; sys.exit(0)\n"])
def test_code_reward_is_zero_for_wrong_broken_or_exiting_code(completion):
    assert code_reward(completion, ADD) == 0.0


# Prints every 32-hex string in its reach (its stack, gc's dicts), then ends at once: it would pass if the
# runner's nonce were among them (it is, without a sandbox.Check: tests/test_sandbox.py)
PRINT_MARKERS = ("import gc, os, re, sys\nfound, frame = [], sys._getframe()\n"
                 "while frame:\n    found += [v for v in frame.f_locals.values() if isinstance(v, str)]\n"
                 "    frame = frame.f_back\n"
                 "found += [v for o in gc.get_objects() if isinstance(o, dict) for v in o.values() if isinstance(v, str)]\n"
                 "print('\\n'.join(v for v in found if re.fullmatch('[0-9a-f]{32}', v)))\nos._exit(0)\n")
RIGGED = "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"


@pytest.mark.parametrize("completion", [
    RIGGED + "def add(a, b):\n    return Any()\n",  # equal to anything
    "class Int(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Int(0)\n",
    "class Str(str):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Str()\n",
    "class F(float):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return F(0)\n",
    "def add(a, b):\n    return 0\ndef check(candidate):\n    pass\n",  # its own check
    "def add(a, b):\n    return 0\ncheck = lambda candidate: None\n",
    "import sys\nsys.exit(0)\n",  # exits before the tests run
    "import os\nos._exit(0)\n",
    "def add(a, b):\n    raise SystemExit(0)\n",  # exits inside check
    "def add(a, b):\n    import os; os._exit(0)\n",
    "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\ndef add(a, b):\n    return 0\n",
    PRINT_MARKERS,  # prints every string in its reach that could be the pass marker, then exits
])
def test_code_reward_is_zero_for_rigged_values_early_exits_and_redefined_checks(completion):
    assert code_reward(completion, ADD) == 0.0


def test_a_completion_cannot_change_the_builtins_or_prompt_helpers_its_tests_use():
    prompt = ("def shift(s):\n    return ''.join(chr(ord(c) + 1) for c in s)\n\n"
              "def unshift(s):\n    \"\"\"Undo shift.\"\"\"\n")
    test = "def check(candidate):\n    assert abs(len(candidate(shift('abc'))) - 3) == 0\n    assert candidate(shift('abc')) == 'abc'\n"
    task = CodeTask("toy/1", prompt, test, "unshift")
    assert code_reward("    return ''.join(chr(ord(c) - 1) for c in s)\n", task) == 1.0
    # shift redefined as the identity, so that the identity would undo it
    assert code_reward("def shift(s):\n    return s\ndef unshift(s):\n    return s\n", task) == 0.0
    assert code_reward("import builtins\nbuiltins.abs = lambda x: 0\ndef unshift(s):\n    return s\n", task) == 0.0


def test_the_tests_expected_values_are_not_in_the_completions_memory():
    """A completion that could read the test source would return its expected values."""
    # every string held by a frame of its stack or by a container gc tracks (nested containers are tracked too)
    probe = ("import gc, sys\nNEEDLE = 'candidate(2' + ', 3) == 5'\n"
             "def strings(o):\n    values = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else []\n"
             "    return [v for v in values if isinstance(v, str)]\n"
             "frames, f = [], sys._getframe()\nwhile f:\n    frames.append(f.f_locals)\n    f = f.f_back\n"
             "FOUND = any(NEEDLE in s and s != NEEDLE for o in frames + gc.get_objects() for s in strings(o))\n"
             "def add(a, b):\n    assert not FOUND, 'the test source is readable'\n    return a + b\n")
    assert code_reward(probe, ADD) == 1.0


# ----------------------------------------------------------------------------- penalties

def test_overlong_penalty_follows_dapo_eq_13():
    kw = dict(max_len=20, buffer=4)
    assert [overlong_penalty(n, **kw) for n in (10, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(3, max_len=4, buffer=0)


def test_repetition_penalty_is_the_repeated_ngram_fraction():
    assert repetition_penalty([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition_penalty([7] * 13) == -0.9  # 10 four-grams, 9 of them repeats
    assert repetition_penalty([1, 2]) == 0.0


# ----------------------------------------------------------------------------- adjustment

groups = st.integers(2, 12).flatmap(lambda g: st.tuples(
    st.lists(st.integers(0, 1), min_size=g, max_size=g),
    st.lists(st.floats(-1, 1), min_size=g, max_size=g),
    st.floats(0, 0.499)))


@settings(max_examples=300, deadline=None)
@given(groups, st.booleans())
def test_adjusted_rewards_never_invert_the_advantage_sign(group, scale_by_std):
    correct, shaping, margin = group
    c = torch.tensor(correct, dtype=torch.float32)
    r = adjust_rewards(c, torch.tensor(shaping), margin=margin)
    adv = group_advantages(r[None], scale_by_std=scale_by_std)[0]
    if 0 < c.sum() < len(c):
        assert (adv[c == 1] > 0).all() and (adv[c == 0] < 0).all()
        assert r[c == 1].min() > r[c == 0].max()  # any correct response above any wrong one
    else:
        assert (adv == 0).all()  # a group of one class stays zero-variance


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=2, max_size=12),
       st.lists(st.floats(0.5 - 0.1, 0.5 + 0.1), min_size=12, max_size=12))
def test_judge_ties_give_zero_advantage(correct, p_better):
    """Judge probabilities inside the dead band are ties: they add exactly nothing."""
    c = torch.tensor(correct, dtype=torch.float32)
    s = judge_score(torch.tensor(p_better[:len(correct)], dtype=torch.float64), dead_band=0.1)
    assert (s == 0).all()
    adv = group_advantages(adjust_rewards(c, s)[None])[0]
    assert torch.equal(adv, group_advantages(c[None])[0])  # only correctness speaks
    if c.min() == c.max():
        assert (adv == 0).all()


def test_judge_outcomes_map_to_plus_one_zero_minus_one():
    outcomes = StubJudge().compare(["q"] * 3, ["ab", "abc", "abcd"], ["abc"] * 3)
    assert judge_score(torch.tensor(outcomes), dead_band=0.2).tolist() == [1.0, 0.0, -1.0]


def test_stub_reward_model_is_deterministic_and_centred_scores_lie_in_the_unit_interval():
    rm = StubRewardModel()
    a = rm.score(["q"] * 4, ["a", "b", "c", "d"])
    assert a == rm.score(["q"] * 4, ["a", "b", "c", "d"]) and all(-1 <= x <= 1 for x in a)
    s = rm_score(torch.tensor([a]), scale=1.0, dead_band=0.1)
    assert s.abs().max() <= 1 and s.shape == (1, 4)


def test_adjust_rewards_rejects_a_margin_that_could_invert():
    with pytest.raises(ValueError, match="margin"):
        adjust_rewards(torch.tensor([1.0, 0.0]), torch.zeros(2), margin=0.5)


def test_shaped_rewards_ramp_the_overlong_penalty_up_to_the_generation_limit_they_are_given():
    correct, ids = torch.tensor([1.0, 1.0, 0.0, 0.0]), [[5] * 16, [5] * 19, [5] * 10, [5] * 18]
    cfg = RewardConfig(overlong_buffer=4)
    r = shaped_rewards(correct, ids, cfg, max_new_tokens=20)
    s = torch.tensor([overlong_penalty(len(x), max_len=20, buffer=4) for x in ids], dtype=torch.float64)
    assert torch.equal(r, adjust_rewards(correct, s, margin=cfg.shaping_margin))
    assert r[0] > r[1] > r[2] > r[3]  # the longer within each class, the lower; every correct one above every wrong one
    assert torch.equal(shaped_rewards(correct, ids, cfg, max_new_tokens=40), correct)  # nothing near a higher limit
    assert shaped_rewards(correct, ids, RewardConfig(), max_new_tokens=20) is correct  # no shaping: as it was
    assert isinstance(stand_in_scorer(RewardConfig(model="stub")), StubRewardModel)
    with pytest.raises(ValueError, match="model='gpt'"):
        RewardConfig(model="gpt")


# ----------------------------------------------------------------------------- overlapped scoring

def flaky(x):
    if x == "boom":
        raise ZeroDivisionError
    if x == "nan":
        return math.nan
    if x == "hang":
        time.sleep(30)
    if x == "stuck":  # where no signal reaches: only a kill ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    return float(len(x))


def test_pool_never_loses_a_rollout_and_counts_why_a_reward_is_zero():
    with RewardPool(flaky, workers=2, timeout_s=0.5) as pool:
        keys = ["ok", "boom", "nan", "hang", "okay"]
        for k in keys:
            pool.submit(k, k)
        rewards, reasons = pool.gather(keys)
    assert rewards == [2.0, 0.0, 0.0, 0.0, 4.0]
    assert reasons == ["ok", "error: ZeroDivisionError", "error: non-finite reward", "timeout", "ok"]
    assert pool.counts == {"ok": 2, "error: ZeroDivisionError": 1, "error: non-finite reward": 1, "timeout": 1}


def test_a_timed_out_thread_worker_is_replaced_so_later_items_are_scored():
    with RewardPool(flaky, workers=1, timeout_s=0.3) as pool:
        keys = ["hang", "fine", "hang", "okay"]
        for i, k in enumerate(keys):
            pool.submit(i, k)
        rewards, reasons = pool.gather(list(range(len(keys))))
    assert rewards == [0.0, 4.0, 0.0, 4.0] and reasons == ["timeout", "ok", "timeout", "ok"]
    assert pool.counts == {"timeout": 2, "ok": 2}


def test_thread_pool_raises_the_gil_switch_interval_only_while_open():
    import sys
    before = sys.getswitchinterval()
    with RewardPool(flaky, workers=1, timeout_s=1.0):
        assert sys.getswitchinterval() == pytest.approx(max(before, scoring.GIL_SWITCH_INTERVAL_S))
    assert sys.getswitchinterval() == before


def test_pool_scores_while_the_caller_goes_on():
    started, release = threading.Event(), threading.Event()

    def waits(x):
        started.set()
        return float(release.wait(5))

    with RewardPool(waits, workers=1, timeout_s=10) as pool:
        pool.submit(0, 0)  # returns at once, though the item cannot finish until we say so
        assert started.wait(5)  # a worker runs it meanwhile
        release.set()
        assert pool.gather([0]) == ([1.0], ["ok"])


def test_process_pool_stops_a_hung_item_kills_a_stuck_worker_and_goes_on():
    with RewardPool(flaky, workers=1, timeout_s=0.5, processes=True) as pool:
        keys = ("hang", "stuck", "boom", "fine")
        for k in keys:
            pool.submit(k, k)
        assert pool.gather(list(keys)) == ([0.0, 0.0, 0.0, 4.0], ["timeout", "timeout", "error: ZeroDivisionError", "ok"])


def test_math_verify_runs_off_the_main_thread():
    with RewardPool(reward.math_reward, workers=1, timeout_s=30) as pool:
        pool.submit("a", "<answer>\\frac{1}{2}</answer>", "0.5")
        assert pool.gather(["a"]) == ([1.0], ["ok"])


# ----------------------------------------------------------------------------- time limits

BOMB = "\\boxed{9^{9^{9^{9}}}}"  # math-verify computes the power: minutes of CPython big-integer arithmetic


def test_inline_scoring_cuts_off_a_hanging_math_verify_and_leaves_no_alarm_behind():
    before = signal.getsignal(signal.SIGALRM)
    assert score_inline(math_reward, BOMB, "4", timeout_s=0.5) == (0.0, "timeout")
    assert score_inline(math_reward, "\\boxed{4}", "4", timeout_s=30) == (1.0, "ok")
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_direct_math_verify_call_keeps_its_own_limit(monkeypatch):
    monkeypatch.setattr(reward, "MATH_TIMEOUT_S", 0.5)
    with pytest.raises(ScoreTimeout):
        math_reward(BOMB, "4")


def swallows_exceptions():
    while True:
        try:
            time.sleep(1)
        except Exception:  # as math-verify's and sympy's broad handlers do
            pass


def test_a_verifier_that_catches_every_exception_is_still_cut_off():
    assert score_inline(swallows_exceptions, timeout_s=0.2) == (0.0, "timeout")


def test_thread_pool_cuts_off_a_hanging_math_verify_without_stopping_the_process():
    """In a thread, math-verify's big-integer power would hold the GIL for minutes, watchdog and caller too."""
    # off the main thread math_equal runs in a grader process; one started here, so that its start-up
    # (imports) is not counted against the items' timeout
    warm = threading.Thread(target=reward.math_equal, args=("4", "4"))
    warm.start()
    warm.join()
    with RewardPool(math_reward, workers=1, timeout_s=1.0) as pool:
        pool.submit("right", "\\boxed{4}", "4")
        pool.submit("bomb", BOMB, "4")
        assert pool.gather(["right", "bomb"]) == ([1.0, 0.0], ["ok", "timeout"])


def test_process_pool_cuts_off_a_hanging_math_verify():
    # 3 s, not 1: the right answer is scored by a fresh grader process after the bomb's is killed, which on a loaded
    # 2-core machine took over a second to start and import math-verify (the bomb takes minutes either way)
    with RewardPool(math_reward, workers=1, timeout_s=3.0, processes=True) as pool:
        pool.submit("bomb", BOMB, "4")
        pool.submit("right", "\\boxed{4}", "4")
        assert pool.gather(["bomb", "right"]) == ([0.0, 1.0], ["timeout", "ok"])


def test_reward_pool_refuses_a_key_never_submitted_instead_of_waiting_forever():
    with RewardPool(lambda x: float(x), workers=1, timeout_s=5.0) as pool:
        pool.submit("a", 1)
        with pytest.raises(KeyError, match="never submitted"):
            pool.gather(["a", "b"])  # "b" would never come: an error at once, not a hang
        assert pool.gather(["a"]) == ([1.0], ["ok"])
        with pytest.raises(KeyError, match="already gathered"):
            pool.gather(["a"])
        pool.submit("c", 2)
        with pytest.raises(ValueError, match="already submitted"):
            pool.submit("c", 3)  # its first result would be overwritten
        assert pool.gather(["c"])[0] == [2.0]
