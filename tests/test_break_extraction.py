"""Golds read strictly and answers that hold more than one candidate value earn nothing (issue 25).

Each case of CASES is a reward, a parsed gold, a skip count or an error that the code before this file's
commit got wrong; the other tests hold what must not change: one answer in its legitimate forms earns
the reward, candidate lists still earn nothing, and every real gold grades itself correct.
"""

import json
import os
import warnings

import pytest

from config import load_config
import data
from data import Item, MathTask, load_task, load_tasks
from reward import final_answer
from test_data import DATA, HUMANEVAL, needs_data, write_jsonl  # the shared data folder and row writer

GSM8K = {"question": "Eggs?", "answer": "16 - 3 - 4 = 9\n#### 18"}


def reward(completion_gold, _tmp) -> float:
    """A MathTask's reward for (completion, gold)."""
    completion, gold = completion_gold
    item = Item("q", gold, 0, 0)
    return MathTask([item]).score(completion, item)


def row_reward(row_completion, tmp) -> float:
    """The reward of a completion on the task of one MATH row."""
    row, completion = row_completion
    task = load_task(write_jsonl(tmp, [{"problem": "p"} | row]))
    return task.score(completion, task[0])


def gold_of(row, tmp) -> str:
    """The gold load_task reads from one MATH row."""
    return load_task(write_jsonl(tmp, [{"problem": "p"} | row])).items[0].answer


def loaded(rows, tmp) -> tuple[int, list[int], list[str]]:
    """(items, skipped line numbers, warnings with tmp written <tmp>) of the task of a file of these rows."""
    path = write_jsonl(tmp, rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = load_task(path)
    return len(task), task.skipped, [str(w.message).replace(str(tmp), "<tmp>") for w in caught]


def sft_load_error(rows, tmp) -> str | None:
    """The error of load_tasks with these HumanEval rows as train_data and sft_steps=5 (None if none)."""
    train, held_out = write_jsonl(tmp, rows, "train.jsonl"), write_jsonl(tmp, [HUMANEVAL], "eval.jsonl")
    cfg = load_config(None, [f"train_data={train}", f"eval_data={held_out}", f"out_dir={tmp / 'run'}", "sft_steps=5"])
    try:
        load_tasks(cfg)
    except ValueError as e:
        return f"ValueError: {e}".replace(str(tmp), "<tmp>")
    return None


NESTED = "\\boxed{\\frac{\\boxed{1}}{2}}"
CASES = [
    # one candidate value per answer: each of these earned 1.0 for the gold among its candidates
    pytest.param(reward, ("\\boxed{17 = 18}", "18"), 0.0, id="chain of ="),
    pytest.param(reward, ("\\boxed{x = 17 = 18}", "18"), 0.0, id="chain of = after a name"),
    pytest.param(reward, ("\\boxed{e = \\pi}", "\\pi"), 0.0, id="a constant is no name"),
    pytest.param(reward, ("\\boxed{17 \\equiv 18}", "18"), 0.0, id="chain of equiv"),
    pytest.param(reward, ("\\boxed{18 \\approx 17}", "18"), 0.0, id="chain of approx"),
    pytest.param(reward, ("\\boxed{18 \\text{ (or maybe 17)}}", "18"), 0.0, id="or in text"),
    pytest.param(reward, ("\\boxed{18 \\text{ (17)}}", "18"), 0.0, id="parenthetical in text"),
    pytest.param(reward, ("\\boxed{18 \\text{(}17\\text{)}}", "18"), 0.0, id="parenthetical in text brackets"),
    pytest.param(reward, ("\\boxed{18_{17}}", "18"), 0.0, id="subscripted alternative"),
    pytest.param(reward, ("\\boxed{18_{(17)}}", "18"), 0.0, id="subscripted parenthetical"),
    pytest.param(reward, ("\\boxed{17} \\boxed{18}", "18"), 0.0, id="two boxes"),
    pytest.param(reward, ("<answer>\\boxed{3} or \\boxed{4}</answer>", "4"), 0.0, id="two boxes in the answer span"),
    pytest.param(reward, ("\\boxed{5} \\text{(or } \\boxed{6})", "6"), 0.0, id="two boxes, one in parentheses"),
    pytest.param(reward, (NESTED, "1"), 0.0, id="an answer's inner box is not the answer"),
    # a box is one answer, the outermost: the gold too
    pytest.param(row_reward, ({"solution": f"${NESTED}$"}, "\\boxed{\\frac{1}{2}}"), 1.0, id="the gold's outer box is the gold"),
    pytest.param(gold_of, {"solution": f"So the answer is ${NESTED}$."}, "\\frac{1}{2}", id="gold: box in a fraction"),
    pytest.param(gold_of, {"solution": "$\\boxed{x + \\boxed{3}}$"}, "x + 3", id="gold: box in a box"),
    pytest.param(gold_of, {"answer": NESTED}, "\\frac{1}{2}", id="gold: a box in the answer field"),
    # a GSM8K gold is a number: a word's anagram would multiply out to the same symbols
    pytest.param(loaded, [GSM8K, GSM8K | {"answer": "#### five"}],
                 (1, [2], ["<tmp>/data.jsonl: skipped 1 rows whose gold is not a number (lines 2)"]), id="gsm8k: word"),
    pytest.param(loaded, [GSM8K | {"answer": "#### x + 1"}, GSM8K | {"answer": "#### $18"}, GSM8K],
                 (1, [1, 2], ["<tmp>/data.jsonl: skipped 2 rows whose gold is not a number (lines 1, 2)"]),
                 id="gsm8k: expression and currency"),
    # SFT needs every training row's demonstration: said at load, not as a traceback at the first SFT step
    pytest.param(sft_load_error, [HUMANEVAL, HUMANEVAL | {"task_id": "toy/1", "canonical_solution": None}],
                 "ValueError: train_data='<tmp>/train.jsonl': <tmp>/train.jsonl, line 2: toy/1 has no canonical_solution, "
                 "which sft_steps=5 needs (SFT imitates each row's; 1 of 2 rows lack one): add them, or set sft_steps=0",
                 id="humaneval without a canonical solution under SFT"),
]


@pytest.mark.parametrize("outcome, given, expected", CASES)
def test_each_way_to_break_extraction_has_its_exact_outcome(outcome, given, expected, tmp_path):
    assert outcome(given, tmp_path) == expected


@pytest.mark.parametrize("answer, gold", [
    ("x = 5", "5"), ("x_{1} = 5", "5"), ("y = 2x + 1", "y = 2x + 1"), ("2x + 1", "y = 2x + 1"),  # equations
    ("(1, 2)", "(1, 2)"), ("[3, 5)", "[3,5)"), ("\\{1, 2\\}", "\\{1,2\\}"), ("3, 5, 7", "3, 5, 7"),  # tuples, sets
    ("1,000", "1000"), ("10,080", "10,\\!080"), ("10080", "10,\\!080"),  # thousands separators
    ("52_8", "52_8"), ("18 \\text{ eggs}", "18"), ("\\frac{1}{2} \\text{ cup}", "0.5"), ("\\text{(C)}", "\\text{(C)}"),
    ("\\boxed{18}", "18"),  # a box in a box is one box
])
def test_one_answer_in_a_legitimate_form_still_earns_the_reward(answer, gold):
    assert reward((f"So $\\boxed{{{answer}}}$.", gold), None) == 1.0


@pytest.mark.parametrize("completion", ["\\boxed{18} and again \\boxed{ 18 }", "in \\boxed{} goes \\boxed{18}",
                                        "<answer>18 eggs</answer>", "work\n#### 18\n"])
def test_the_same_box_twice_an_empty_box_and_unboxed_answers_are_one_answer(completion):
    assert final_answer(completion, "18") in ("18", "18 eggs") and reward((completion, "18"), None) == 1.0


@pytest.mark.parametrize("completion", ["\\boxed{3, 4}", "<answer>4 or 5</answer>", "\\boxed{4 \\text{ or } 5}",
                                        "\\boxed{y = 2x + 1 = 3}", "\\boxed{4", "\\boxed{4} \\boxed{5"])
@pytest.mark.parametrize("gold", ["4", "y = 2x + 1"])
def test_candidate_lists_chains_and_open_boxes_still_earn_nothing(completion, gold):
    assert reward((completion, gold), None) == 0.0


def test_every_math_score_is_the_verifiers_on_the_completion_as_written(monkeypatch):
    graded = []  # tests/test_hf_run.py counts MathTask's calls of reward.math_reward, one a completion
    monkeypatch.setattr(data, "math_reward", lambda completion, gold: graded.append((completion, gold)) or 0.0)
    item, completions = Item("q", "18", 0, 0), ("no answer at all", "\\boxed{17} \\boxed{18}", "\\boxed{18}")
    for completion in completions:
        MathTask([item]).score(completion, item)
    assert graded == [(c, "18") for c in completions]  # reward.math_reward reads the one answer (final_answer)


def test_a_math_row_whose_answer_field_is_an_empty_box_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: empty gold answer: the answer field is an empty \\boxed"):
        load_task(write_jsonl(tmp_path, [{"problem": "p", "answer": "\\boxed{ }"}]))


def test_humaneval_rows_without_a_canonical_solution_load_without_sft_and_as_eval_data(tmp_path):
    bare = [HUMANEVAL | {"canonical_solution": None}]
    train, held_out = write_jsonl(tmp_path, [HUMANEVAL], "train.jsonl"), write_jsonl(tmp_path, bare, "eval.jsonl")
    for sft_steps, files in [(5, (train, held_out)), (0, (held_out, held_out))]:
        cfg = load_config(None, [f"train_data={files[0]}", f"eval_data={files[1]}", f"out_dir={tmp_path / 'run'}",
                                 f"sft_steps={sft_steps}"])
        assert [len(t) for t in load_tasks(cfg)] == [1, 1]


@needs_data
def test_every_real_gold_grades_itself_correct(tmp_path):
    """MATH-500 (its answer field, and its solutions' outermost last boxes: the same golds) and GSM8K's test
    set: each gold, as the one boxed answer its demonstration writes, earns 1.0."""
    with open(os.path.join(DATA, "math500_test.jsonl")) as f:
        answers = [{"problem": r["problem"], "answer": r["answer"]} for r in map(json.loads, f)]
    with open(os.path.join(DATA, "math500_test.jsonl")) as f:
        solutions = [{"problem": r["problem"], "solution": r["solution"]} for r in map(json.loads, f)]
    by_solution = load_task(write_jsonl(tmp_path, solutions))
    assert [it.answer for it in by_solution.items] == [r["answer"].strip() for r in answers]
    for task in (load_task(write_jsonl(tmp_path, answers)), load_task(os.path.join(DATA, "gsm8k_test.jsonl"))):
        wrong = [it.answer for it in task.items if task.score(task.demonstration(it), it) != 1.0]
        assert len(task) in (500, 1319) and task.skipped == [] and wrong == []
