"""A user's dataset files as tasks: formats detected from the fields, bad input refused before any work."""

import json
import os
import re

import pytest

from config import load_config
from data import HumanEvalTask, Item, MATH_INSTRUCTION, MathTask, PromptTask, TaskMix, load_task, load_tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("EVERYPROMPT_DATA", os.path.join(REPO, "..", "shared", "data"))
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason=f"real datasets not found at {DATA} (EVERYPROMPT_DATA)")

GSM8K = {"question": "Eggs: 16 laid, 3 eaten, 4 baked; sold at $2. Dollars?", "answer": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 1,018"}
MATH = {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}"}
MATH_SOLUTION = {"problem": "What is $2^{10}$?", "solution": "We get $\\boxed{512}$, no: $2^{10} = \\boxed{1024}$."}
HUMANEVAL = {"task_id": "toy/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n',
             "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add",
             "canonical_solution": "    return a + b\n"}


def write_jsonl(tmp_path, rows, name="data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_rows_become_a_math_task_whose_gold_is_the_last_hash_line_without_commas(tmp_path):
    task = load_task(write_jsonl(tmp_path, [GSM8K, GSM8K | {"answer": "#### 5\n#### 7"}]))
    assert isinstance(task, MathTask) and [it.answer for it in task.items] == ["1018", "7"]
    assert task.items[0] == Item(GSM8K["question"], "1018", 0, 0)
    assert task.score("so <answer>1018</answer>", task[0]) == 1.0 and task.score("\\boxed{1019}", task[0]) == 0.0


def test_math_rows_take_the_answer_field_or_else_the_solutions_last_box(tmp_path):
    task = load_task(write_jsonl(tmp_path, [MATH, MATH_SOLUTION]))
    assert [it.answer for it in task.items] == ["\\frac{3}{4}", "1024"]
    assert task.score("\\boxed{0.75}", task[0]) == 1.0


def test_humaneval_rows_become_a_code_task_scored_in_the_sandbox(tmp_path):
    task = load_task(write_jsonl(tmp_path, [HUMANEVAL, {k: v for k, v in HUMANEVAL.items() if k != "task_id"}]))
    assert isinstance(task, HumanEvalTask) and task[1].index == 1
    assert task.problems[task[1].index].task_id == "data.jsonl:2"  # no task_id: the file and line
    assert task.score("```python\ndef add(a, b):\n    return a + b\n```", task[0]) == 1.0
    assert task.score("    return a - b\n", task[0]) == 0.0


def test_parquet_files_are_read_like_jsonl(tmp_path):
    import pyarrow
    import pyarrow.parquet
    path = str(tmp_path / "data.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([MATH, MATH]), path)
    assert [it.answer for it in load_task(path).items] == ["\\frac{3}{4}"] * 2
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"problem": "p", "answer": 3}]), path)
    with pytest.raises(ValueError, match=r"data.parquet, row 1: field 'answer' must be a string, got int"):
        load_task(path)


def test_size_keeps_the_first_rows_but_every_row_is_checked(tmp_path):
    path = write_jsonl(tmp_path, [MATH] * 3 + [{"problem": "p"}])
    with pytest.raises(ValueError, match="line 4"):
        load_task(path, size=2)
    assert len(load_task(write_jsonl(tmp_path, [MATH] * 3), size=2)) == 2


@pytest.mark.parametrize("rows, message", [
    ([], "no rows"),
    ([GSM8K, "{not json"], r"line 2: not valid JSON"),
    ([GSM8K, "[1, 2]"], r"line 2: expected a JSON object, got a list"),
    ([GSM8K, MATH], r"line 2: missing field 'question'.*GSM8K format, from the first row"),
    ([MATH, GSM8K], r"line 2: missing field 'problem'"),
    ([GSM8K | {"answer": 1018}], r"line 1: field 'answer' must be a string, got int"),
    ([GSM8K | {"answer": "no marker"}], r"line 1: answer has no '#### <gold>' line"),
    ([GSM8K | {"answer": "work\n####  \n"}], r"line 1: empty gold answer"),
    ([MATH | {"answer": " "}], r"line 1: field 'answer' is empty"),
    ([{"problem": "p", "solution": "no box"}], r"line 1: solution has no \\boxed"),
    ([{"problem": "p", "solution": "\\boxed{}"}], r"line 1: empty gold answer"),
    ([HUMANEVAL | {"entry_point": "not a name"}], r"line 1: entry_point 'not a name' is not a Python name"),
    ([HUMANEVAL | {"test": "assert True\n"}], r"line 1: test does not define check"),
    ([{"prompt": "1+1", "solution": "2"}], r"line 1: unknown row format, fields \['prompt', 'solution'\]"),
    ([{"prompt": "def f():", "entry_point": "f"}], r"line 1: unknown row format.*or prompt-only"),
    ([{"prompt": "Say hi."}, {"prompt": "2+2?", "answer": "4"}], r"line 2: has answer: a prompt-only file's rows"),
    ([{"prompt": "Say hi."}, {"prompt": ""}], r"line 2: field 'prompt' is empty.*prompt-only format"),
])
def test_bad_input_is_refused_naming_the_file_line_and_what_was_expected(tmp_path, rows, message):
    path = write_jsonl(tmp_path, rows)
    with pytest.raises(ValueError, match=message) as e:
        load_task(path)
    assert path in str(e.value)


def test_line_numbers_count_blank_lines_and_other_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"line 3: not valid JSON"):
        load_task(write_jsonl(tmp_path, [MATH, "", "{"]))
    with pytest.raises(ValueError, match="expected a .jsonl"):
        load_task(str(tmp_path / "data.csv"))


def test_a_math_gold_that_math_verify_cannot_read_is_skipped_and_counted(tmp_path):
    task = load_task(write_jsonl(tmp_path, [MATH, MATH | {"answer": "\\frac{"}, MATH]))
    assert len(task) == 2 and task.skipped == [2] and [it.index for it in task.items] == [0, 1]


def test_each_task_words_its_prompt_for_a_chat_model(tmp_path):
    math = load_task(write_jsonl(tmp_path, [MATH]))
    assert math.user_message(math[0]) == f"{MATH['problem']}\n{MATH_INSTRUCTION}"
    assert MATH_INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."
    code = load_task(write_jsonl(tmp_path, [HUMANEVAL], name="code.jsonl"))
    message = code.user_message(code[0])
    assert f"```python\n{HUMANEVAL['prompt'].rstrip()}\n```" in message and "```python code block" in message
    mix = TaskMix([("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1))], seed=0, size=2)
    assert mix.user_message(mix[0]) == mix[0].question  # the demo's prompts, ids and all, stay as they were


def test_bad_task_specs_and_data_files_are_refused_naming_their_setting(tmp_path):
    with pytest.raises(ValueError, match=r"tasks\[1\]=\('chain_sum', \{'no_such_kwarg': 1\}\): reasoning-gym refuses it"):
        TaskMix([("chain_sum", {}), ("chain_sum", dict(no_such_kwarg=1))], seed=0, size=2)
    good, bad = write_jsonl(tmp_path, [MATH]), write_jsonl(tmp_path, [MATH, {"problem": "p"}], name="bad.jsonl")

    def tasks(train, evals):
        return load_tasks(load_config(None, [f"train_data={train}", f"eval_data={evals}", f"out_dir={tmp_path / 'run'}"]))
    assert [len(t) for t in tasks(good, good)] == [1, 1]
    with pytest.raises(ValueError, match=re.escape(f"train_data={bad!r}: ") + ".*line 2"):
        tasks(bad, good)
    with pytest.raises(ValueError, match=re.escape(f"eval_data={str(tmp_path / 'none.jsonl')!r}: no such file")):
        tasks(good, tmp_path / "none.jsonl")


def test_prompt_only_rows_load_without_gold_only_for_a_reward_that_reads_none(tmp_path):
    """Rows of just a prompt (extra fields ignored) are a PromptTask whose verifier pays 0, accepted by load_tasks
    under reward.rm_only with a scalar reward model and refused naming the setting otherwise: rm_only off, a judge
    (it reads the gold as its reference), or SFT (nothing to imitate)."""
    prompts = write_jsonl(tmp_path, [{"prompt": "Write a haiku about rain.", "id": 7}, {"prompt": "Say hi."}],
                          name="prompts.jsonl")
    task = load_task(prompts)
    assert isinstance(task, PromptTask) and [(it.question, it.answer) for it in task.items] == [
        ("Write a haiku about rain.", ""), ("Say hi.", "")]
    assert task.user_message(task[0]) == "Write a haiku about rain." and task.score("anything", task[0]) == 0.0
    gold = write_jsonl(tmp_path, [MATH])

    def tasks(train, evals, *more):
        return load_tasks(load_config(None, [f"train_data={train}", f"eval_data={evals}", f"out_dir={tmp_path / 'run'}",
                                             "sft_steps=0", *more]))
    train, held_out = tasks(prompts, gold, "reward.rm_only=True", "reward.model=stub")
    assert isinstance(train, PromptTask) and isinstance(held_out, MathTask)
    assert all(isinstance(t, PromptTask) for t in tasks(prompts, prompts, "reward.rm_only=True", "reward.model=stub"))
    with pytest.raises(ValueError, match=re.escape(f"train_data={prompts!r}: prompt-only rows") + ".*"
                       + re.escape("reward.rm_only=False")):
        tasks(prompts, gold)
    with pytest.raises(ValueError, match=re.escape(f"eval_data={prompts!r}: prompt-only rows") + ".*rm_only=False"):
        tasks(gold, prompts)
    with pytest.raises(ValueError, match=r"reward.model='stub-judge' is a judge"):
        tasks(prompts, gold, "reward.rm_only=True", "reward.model=stub-judge")
    with pytest.raises(ValueError, match=r"no answer for sft_steps=3 to imitate; set sft_steps=0"):
        tasks(prompts, gold, "reward.rm_only=True", "reward.model=stub", "sft_steps=3")


def test_demonstrations_earn_the_full_reward(tmp_path):
    math = load_task(write_jsonl(tmp_path, [MATH, MATH_SOLUTION]))
    assert all(math.score(math.demonstration(it), it) == 1.0 for it in math.items)
    code = load_task(write_jsonl(tmp_path, [HUMANEVAL, HUMANEVAL | {"canonical_solution": None}], name="code.jsonl"))
    assert code.score(code.demonstration(code[0]), code[0]) == 1.0
    with pytest.raises(ValueError, match="toy/0 has no canonical_solution"):
        code.demonstration(code[1])


@needs_data
@pytest.mark.parametrize("name, size", [("gsm8k_train.jsonl", 7473), ("gsm8k_test.jsonl", 1319),
                                        ("math500_test.jsonl", 500)])
def test_the_real_datasets_load_whole(name, size):
    task = load_task(os.path.join(DATA, name))
    assert len(task) == size and task.skipped == []
    assert all(task.score(task.demonstration(it), it) == 1.0 for it in task.items[:20])


ZWSP = "\u200b"  # a zero-width space, as text pasted from a web page carries it


def test_a_file_whose_every_gold_is_unreadable_is_refused_counting_the_rows_and_naming_the_character(tmp_path):
    """GSM8K golds ending in a zero-width space: every row is dropped, and the error says so when the file is read,
    counted and with the character named, not later as "no prompt fits max_prompt_tokens"."""
    path = write_jsonl(tmp_path, [GSM8K | {"answer": f"#### {n}{ZWSP}"} for n in (18, 7, 3)])
    with pytest.raises(ValueError) as e:
        load_task(path)
    assert str(e.value) == (f"{path}: no usable row: 3 rows read, all 3 dropped as their gold is not a number (lines "
                            f"1, 2, 3; the first: '18\\u200b', which holds U+200B ZERO WIDTH SPACE); write each gold "
                            f"after '####' as a plain number (digits, a sign, decimals)")


def run_data_error(tmp_path, train_rows, *settings) -> str:
    """The error of data.load_run_data (what train.prepare reads before any work) on these training rows."""
    from data import load_run_data
    held_out = write_jsonl(tmp_path, [GSM8K | {"question": "2+2?"}], "eval.jsonl")  # a short prompt, which fits
    train = write_jsonl(tmp_path, train_rows, "train.jsonl")
    cfg = load_config(None, [f"train_data={train}", f"eval_data={held_out}", f"out_dir={tmp_path / 'run'}",
                             "sft_steps=0", "eval_size=1", *settings])
    with pytest.raises(ValueError) as e:
        load_run_data(cfg)
    return str(e.value).replace(str(tmp_path), "<tmp>")


def test_a_run_whose_training_rows_all_drop_says_how_many_for_which_reason(tmp_path):
    """Every training gold unreadable: the run's error counts the rows and names the cause."""
    rows = [GSM8K | {"answer": f"#### {n}{ZWSP}"} for n in (18, 7, 3)]
    assert run_data_error(tmp_path, rows) == (
        "train_data='<tmp>/train.jsonl': <tmp>/train.jsonl: no usable row: 3 rows read, all 3 dropped as their gold is "
        "not a number (lines 1, 2, 3; the first: '18\\u200b', which holds U+200B ZERO WIDTH SPACE); write each gold "
        "after '####' as a plain number (digits, a sign, decimals)")


def test_no_prompt_left_counts_each_cause_and_says_what_to_change(tmp_path):
    """One gold unreadable, the other prompts too long: the error counts both, and gives the limit that fits."""
    rows = [GSM8K | {"answer": f"#### 18{ZWSP}"}, GSM8K | {"question": "long " * 40}, GSM8K | {"question": "long " * 60}]
    error = run_data_error(tmp_path, rows, "max_prompt_tokens=80")
    shortest = int(re.search(r"the shortest has (\d+) tokens", error).group(1))
    assert error == (
        f"max_prompt_tokens=80: all 2 training prompts are longer than max_prompt_tokens=80 (the shortest has {shortest} "
        f"tokens); before that, 3 rows read, 1 dropped as their gold is not a number (lines 1; the first: "
        f"'18\\u200b', which holds U+200B ZERO WIDTH SPACE): a prompt of {shortest} tokens fits with max_prompt_tokens "
        f">= {shortest} (0: all that fits) and model.max_seq_len - sampling.max_new_tokens >= {shortest}; or shorten "
        f"the prompts")
