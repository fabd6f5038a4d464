"""Verifiers, penalties, the advantage-inversion guard and overlapped scoring."""

import json
import math
import os
import re
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reward
from espo import group_advantages
from reward import (CodeTask, MathTask, RewardPool, StubJudge, StubRewardModel, adjust_rewards, code_reward,
                    extract_answer, judge_score, math_reward, overlong_penalty, repetition_penalty, rm_score)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason=f"real datasets not found at {DATA}")


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


@needs_data
@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "math500_test.jsonl"])
def test_gold_answers_written_as_a_model_would_are_graded_correct_and_perturbed_ones_wrong(name):
    path = os.path.join(DATA, name)
    task = MathTask(path)
    golds = raw_golds(path)
    assert len(task) == len(golds) >= 500
    forms = [lambda g: f"Let me work it out.\n<answer>{g}</answer>", lambda g: f"So the answer is $\\boxed{{{g}}}$."]
    for form in forms:
        right = sum(task.score(form(g), it) for g, it in zip(golds, task.items))
        assert right >= 0.995 * len(task), (name, right)
    wrong = sum(task.score(f"<answer>{perturb(g)}</answer>", it) for g, it in zip(golds, task.items))
    assert wrong <= 0.005 * len(task), (name, wrong)


def test_math_task_rejects_rows_of_an_unknown_layout(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match="expected GSM8K"):
        MathTask(str(path))


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


# ----------------------------------------------------------------------------- overlapped scoring

def flaky(x):
    if x == "boom":
        raise ZeroDivisionError
    if x == "nan":
        return math.nan
    if x == "hang":
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
        assert sys.getswitchinterval() == pytest.approx(max(before, reward.GIL_SWITCH_INTERVAL_S))
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


def test_process_pool_kills_a_hung_worker_and_goes_on():
    with RewardPool(flaky, workers=1, timeout_s=1.0, processes=True) as pool:
        for k in ("hang", "boom", "fine"):
            pool.submit(k, k)
        assert pool.gather(["hang", "boom", "fine"]) == ([0.0, 0.0, 4.0], ["timeout", "error: ZeroDivisionError", "ok"])


def test_math_verify_runs_off_the_main_thread():
    with RewardPool(reward.math_reward, workers=1, timeout_s=30) as pool:
        pool.submit("a", "<answer>\\frac{1}{2}</answer>", "0.5")
        assert pool.gather(["a"]) == ([1.0], ["ok"])
