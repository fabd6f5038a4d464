"""A run's prompts: the tasks (`Item`, `Task`; reasoning-gym's `TaskMix`, and the datasets a user
brings as JSONL or parquet files of GSM8K, MATH, HumanEval or prompt-only rows: `load_task`, `load_tasks`), and
the training prompts tokenized once, in a fixed random order (`Prompts`; `prompt_ids`: an item in
the tokenizer's chat template). Each task scores with a verifier of reward.py.

A task (`Task`) is `items`, `score(completion, item)`, `exclude`, `user_message(item)` and
`demonstration(item)`. reasoning-gym's seeds: item i of seed s equals item i-1 of seed s+1, so
train and eval seeds must lie further apart than the train size; `exclude` drops eval items whose
question also appears in training.

`load_task(path, size=...)` reads a file, detects its format from the first row's fields,
checks every row before any work (a ValueError names the file, the 1-based line, or row
of a parquet file, and what was expected) and returns its task. A math task grades the one
final answer reward.final_answer reads out of a completion (reward.math_reward).

Formats, tried in this order on the first row; every row must then have that format:
1. HumanEval (arXiv 2107.03374): prompt, test (defining check(candidate)), entry_point;
   task_id and canonical_solution optional. Scored in the sandbox (reward.code_reward);
   `HumanEvalTask.problems[item.index]` is an item's CodeTask.
2. MATH (arXiv 2103.03874): problem and answer (MATH-500's layout), or problem and
   solution, whose last outermost \\boxed{} is the gold, boxes inside it unwrapped
   (reward.outer_boxes). Scored by reward.math_reward.
3. GSM8K (arXiv 2110.14168): question and answer, whose last `####` line holds the gold
   (thousands commas removed: "1,600" -> "1600"). Scored by reward.math_reward.
4. Prompt-only: prompt and none of the gold-bearing fields (answer, solution, test,
   entry_point, canonical_solution); other fields are ignored. No gold: a `PromptTask`, whose
   verifier pays 0, loaded only for a run whose reward reads no gold (reward.rm_only with a
   scalar reward model: RewardConfig.reads_gold False), checked in `load_tasks`.

Notable choices:
1. A math row whose gold math-verify cannot read as an expression, or a GSM8K gold that is
   not a plain number ("#### five": math-verify would read it as the product f*i*v*e, which
   "vife" equals), is skipped and counted (`task.skipped`, the rows' line numbers; a warning
   gives the count), not an error: one odd row among thousands should not stop a run. A file
   none of whose rows is usable is an error counting them, with the first gold shown and any
   invisible character in it named (a zero-width space pasted from a web page); an error for
   prompts missing later (none within max_prompt_tokens, too few to evaluate) repeats the
   count (`Task.dropped`), so it never blames the prompt limit for rows dropped here. A
   gold that is a plain number is readable and not parsed, so a GSM8K file loads without
   math-verify's cost per row.
2. An empty file, an empty gold answer, bad JSON, a missing field or one of the wrong
   type are errors, raised before any row becomes a task. A missing value in parquet
   (None) counts as a missing field.
3. The prompt for a chat model (`user_message`): math appends MATH_INSTRUCTION, the
   instruction of Qwen2.5-Math's README and of DeepSeek-R1's usage recommendations
   (arXiv 2501.12948); code asks for the completed function in a ```python block.
4. `size` keeps the first `size` usable rows; every row of the file is still checked.
5. An SFT warm-up imitates each training row's demonstration: with sft_steps > 0 a
   HumanEval row without a canonical_solution is an error at load, naming its line.
6. One answer, one value: reward.math_reward pays nothing for an answer with more than one
   candidate (reward.final_answer), so neither do the tasks here.
7. A prompt-only row is `{"prompt": ...}` and no answer-bearing field: "prompt" is HumanEval's
   field too, so a HumanEval row that lost its test is an unknown format rather than a prompt,
   and a prompt-only file whose later row carries a gold is refused (a mixed file is a mistake).
   Its items' answer is "" (Item.answer is always a str); nothing reads it, as `load_tasks`
   allows such a file only when the reward reads no gold, and refuses SFT on it (no demonstration).
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from reward import (PLAIN_NUMBER_RE, code_reward, math_gold_readable, math_reward, outer_boxes,
                    reasoning_gym_reward, unbox)

from tokenizer import Tokenizer, demo_tokenizer, load_hf_tokenizer, train_tokenizer
from tool_calls import tool_schemas, tool_words

if TYPE_CHECKING:
    from config import TrainConfig

# the math instruction of Qwen2.5-Math's README (CoT) and DeepSeek-R1's usage recommendations (arXiv 2501.12948)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block."
CHECK_RE = re.compile(r"^def check\s*\(", re.MULTILINE)  # HumanEval's test defines check(candidate)
# fields that carry or imply a gold answer: a row with any of them is not prompt-only (choice 7)
GOLD_FIELDS = ("answer", "solution", "test", "entry_point", "canonical_solution")
# Unicode categories of characters an error message would show as nothing, or as plain space: format (zero-width
# space, direction marks), control, separators, private use, unassigned
INVISIBLE = ("Cf", "Cc", "Zs", "Zl", "Zp", "Co", "Cn")


# ----------------------------------------------------------------------------- tasks

@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    task: int  # index into the mix's datasets
    index: int  # index within that dataset


class Task:
    """A task's prompts as a list of Item (`self.items`), indexable, with eval de-duplication.

    A task (TaskMix; MathTask and HumanEvalTask for a user's files) also has
    score(completion, item) -> float (binary, may raise scoring.ScoreTimeout), user_message(item)
    -> str (the prompt's text for a chat model) and demonstration(item) -> str (an SFT target).
    """
    items: list[Item]
    has_gold: bool = True  # whether score grades against a gold answer; without one (PromptTask) no accuracy exists

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i: int) -> Item:
        return self.items[i]

    def exclude(self, questions: set[str]) -> list[Item]:
        """The items whose question is not in `questions` (eval de-duplication)."""
        return [it for it in self.items if it.question not in questions]

    def user_message(self, item: Item) -> str:
        """The prompt's text for a chat model; by default the question as it is."""
        return item.question

    def dropped(self) -> str:
        """The rows its file held that loading left out, and why, for an error that says why prompts are missing
        ("" when none was: every row is an item)."""
        return ""


class TaskMix(Task):
    """Round-robin mix of reasoning-gym datasets: item i comes from dataset i % num_tasks.

    specs: list of (dataset name, kwargs) for `reasoning_gym.create_dataset` (a run's `tasks`).
    Raises ValueError on an empty spec list, or naming `tasks[i]` on a spec reasoning-gym refuses.
    """

    def __init__(self, specs: list[tuple[str, dict]], *, seed: int, size: int):
        import reasoning_gym  # here, not at the top: only a run without train_data needs it (not the GPU check)
        if not specs:
            raise ValueError("TaskMix needs at least one (name, kwargs) spec")
        per_task = -(-size // len(specs))  # ceil: each dataset holds at least its round-robin share
        self.datasets = []
        for i, (name, kwargs) in enumerate(specs):
            try:
                self.datasets.append(reasoning_gym.create_dataset(name, seed=seed, size=per_task, **kwargs))
            except Exception as e:  # noqa: BLE001  reasoning-gym raises KeyError, ValueError, TypeError, AssertionError
                raise ValueError(f"tasks[{i}]=({name!r}, {kwargs!r}): reasoning-gym refuses it ({type(e).__name__}: "
                                 f"{e})") from None
        self.items = []
        # round robin, so any prefix of the items (a smaller size, the first steps' prompts) holds every
        # dataset in equal share
        for i in range(size):
            t, j = i % len(specs), i // len(specs)
            entry = self.datasets[t][j]
            self.items.append(Item(entry["question"], str(entry["answer"]), t, j))  # a dataset's gold may be a number

    def score(self, completion: str, item: Item) -> float:
        """Binary reward: 1.0 iff reasoning-gym's scorer gives the last <answer> span full marks."""
        ds = self.datasets[item.task]
        return reasoning_gym_reward(completion, ds, ds[item.index])

    def demonstration(self, item: Item) -> str:
        return demonstration(item)


def demonstration(item: Item) -> str:
    """The completion an SFT warm-up imitates on a TaskMix: the gold answer in answer tags."""
    return f"<answer>{item.answer}</answer>"


@dataclass(frozen=True)
class CodeTask:
    """A HumanEval-format task: `test` defines check(candidate), which asserts on entry_point."""
    task_id: str
    prompt: str  # imports, the signature and the docstring
    test: str
    entry_point: str
    canonical_solution: str = ""  # the reference body that continues the prompt ("" if the data has none)


class MathTask(Task):
    """GSM8K or MATH rows, graded by reward.math_reward on the completion's one final answer (reward.final_answer).
    `skipped`: line numbers of rows whose gold math-verify cannot read, or a GSM8K gold that is no number
    (see the module docstring), `why` they were, the first one's gold (`example`), `rows`: the rows read, and `path`:
    their file."""

    def __init__(self, items: list[Item], *, skipped: list[int] | None = None, why: str = "", example: str = "",
                 rows: int | None = None, path: str = ""):
        self.items, self.skipped, self.why, self.example, self.path = items, skipped or [], why, example, path
        self.rows = len(self.items) + len(self.skipped) if rows is None else rows

    def dropped(self) -> str:
        if not self.skipped:
            return ""
        return (f"{self.rows} rows read, {'all ' * (len(self.skipped) == self.rows)}{len(self.skipped)} dropped as "
                f"their gold {self.why} ({_lines(self.skipped, self.path)}; the first: {shown(self.example)})")

    def score(self, completion: str, item: Item) -> float:
        """1.0 if the completion's one final answer equals the gold; raises scoring.ScoreTimeout past its limit."""
        return math_reward(completion, item.answer)

    def user_message(self, item: Item) -> str:
        return f"{item.question}\n{MATH_INSTRUCTION}"

    def demonstration(self, item: Item) -> str:
        """The gold in \\boxed{}, the form user_message asks for."""
        return f"\\boxed{{{item.answer}}}"


class HumanEvalTask(Task):
    """HumanEval-format problems, run in the sandbox by reward.code_reward; `problems[item.index]` is an
    item's CodeTask, and an item's answer its canonical solution ("" if the data has none)."""

    def __init__(self, problems: list[CodeTask]):
        self.problems = problems
        self.items = [Item(p.prompt, p.canonical_solution, 0, i) for i, p in enumerate(problems)]

    def score(self, completion: str, item: Item) -> float:
        return code_reward(completion, self.problems[item.index])

    def user_message(self, item: Item) -> str:
        return f"{CODE_INSTRUCTION}\n\n```python\n{item.question.rstrip()}\n```"

    def demonstration(self, item: Item) -> str:
        """The prompt completed by the canonical solution, in a ```python block. Raises ValueError without one."""
        problem = self.problems[item.index]
        if not problem.canonical_solution:
            raise ValueError(f"{problem.task_id} has no canonical_solution to make a demonstration of")
        return f"```python\n{problem.prompt}{problem.canonical_solution.rstrip()}\n```"


class PromptTask(Task):
    """Prompt-only rows (choice 7): no gold, so no verifier. Its score is 0.0 for every completion: a run on it
    rewards by its reward model alone (reward.rm_only), and as held-out prompts it has no accuracy to measure
    (evaluation.run_eval measures none)."""
    has_gold = False

    def __init__(self, items: list[Item]):
        self.items = items

    def score(self, completion: str, item: Item) -> float:
        return 0.0

    def demonstration(self, item: Item) -> str:
        """Raises ValueError: a prompt-only row has no answer to imitate (load_tasks refuses SFT on one first)."""
        raise ValueError(f"prompt-only row {item.index} has no answer to make a demonstration of")


def load_task(path: str, *, size: int | None = None,
              sft_steps: int = 0) -> MathTask | HumanEvalTask | PromptTask:
    """The task of a JSONL or parquet file of GSM8K, MATH, HumanEval or prompt-only rows (module docstring).

    size: keep the first `size` usable rows (None: all). sft_steps: the SFT warm-up's steps
    on these rows; with any, each HumanEval row needs a canonical_solution to imitate.
    Raises ValueError on a file that is empty, not JSONL or parquet, or holds a row that
    does not fit the first row's format (or lacks a canonical_solution SFT needs);
    FileNotFoundError if there is no such file. Warns with the count of skipped rows.
    """
    if size is not None and size < 1:
        raise ValueError(f"size={size} must be >= 1 (or None for every row)")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file)")
    where = _where(path, rows[0][0])
    kind = _detect(rows[0][1])
    if kind is None:
        raise ValueError(f"{where}: unknown row format, fields {sorted(rows[0][1])}; expected HumanEval "
                         f"(prompt, test, entry_point), MATH (problem, answer or solution), GSM8K (question, answer) "
                         f"or prompt-only (prompt and none of {', '.join(GOLD_FIELDS)})")
    parse_row = {"HumanEval": _humaneval_row, "MATH": _math_row, "GSM8K": _gsm8k_row,
                 "prompt-only": _prompt_row}[kind]
    parsed = []
    for line, row in rows:  # every row, before any work: a bad one anywhere stops the run here
        try:
            parsed.append((line, parse_row(row, f"{os.path.basename(path)}:{line}")))
        except _RowError as e:
            raise ValueError(f"{_where(path, line)}: {e} ({kind} format, from the first row)") from None
    if kind == "HumanEval":
        parsed = parsed[:size]
        # here, not at the first SFT step's demonstration: after the model is built, a traceback mid-run
        if sft_steps and (bare := [(line, p) for line, p in parsed if not p.canonical_solution]):
            line, problem = bare[0]
            raise ValueError(f"{_where(path, line)}: {problem.task_id} has no canonical_solution, which "
                             f"sft_steps={sft_steps} needs (SFT imitates each row's; {len(bare)} of {len(parsed)} "
                             f"rows lack one): add them, or set sft_steps=0")
        return HumanEvalTask([problem for _, problem in parsed])
    if kind == "prompt-only":
        return PromptTask([Item(prompt, "", 0, i) for i, (_, prompt) in enumerate(parsed[:size])])
    # a GSM8K gold is a number: any other text math-verify reads as symbols, and an anagram of a word multiplies
    # out to the same product
    usable = PLAIN_NUMBER_RE.fullmatch if kind == "GSM8K" else math_gold_readable
    items, skipped, example = [], [], ""
    for line, (question, gold) in parsed:
        if size is not None and len(items) == size:
            break
        if usable(gold):
            items.append(Item(question, gold, 0, len(items)))
        else:
            skipped.append(line)
            example = example or gold
    why = "is not a number" if kind == "GSM8K" else "math-verify cannot read"
    task = MathTask(items, skipped=skipped, why=why, example=example, rows=len(parsed), path=path)
    if not items:  # said here, not later as "no prompt fits" or "too few eval rows": the cause, counted
        fix = ("write each gold after '####' as a plain number (digits, a sign, decimals)" if kind == "GSM8K" else
               "write each gold as LaTeX math-verify reads, such as \\frac{1}{2}")
        raise ValueError(f"{path}: no usable row: {task.dropped()}; {fix}")
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped)} rows whose gold {why} ({_lines(skipped, path)})", stacklevel=2)
    return task


def _lines(numbers: list[int], path: str = "") -> str:
    # "lines 1, 2, ..." (parquet: "rows"), the first five
    unit = "rows" if path.endswith(".parquet") else "lines"
    return f"{unit} {', '.join(map(str, numbers[:5]))}{', ...' if len(numbers) > 5 else ''}"


def shown(text: str) -> str:
    """text as an error shows it: its repr, naming each invisible character in it (a zero-width space, a
    direction mark, a control character), which a reader of the message would otherwise not see."""
    odd = sorted({c for c in text if unicodedata.category(c) in INVISIBLE and c != " "})
    names = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, '(unnamed)')}" for c in odd)
    return repr(text) + (f", which holds {names}" if odd else "")


class _RowError(Exception):
    """What is wrong with one row; load_task adds the file and line."""


def _where(path: str, line: int) -> str:
    return f"{path}, {'row' if path.endswith('.parquet') else 'line'} {line}"


def _read_rows(path: str) -> list[tuple[int, dict]]:
    """(1-based line or row number, row) of a JSONL or parquet file; blank JSONL lines are not rows."""
    if path.endswith(".parquet"):
        import pyarrow.parquet  # here: only a parquet file needs it (the `datasets` requirement brings it)
        try:
            table = pyarrow.parquet.read_table(path)
        except (OSError, pyarrow.ArrowException) as e:  # ArrowInvalid: not parquet at all
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"{path}: not a readable parquet file ({e})") from e
        return list(enumerate(table.to_pylist(), 1))
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"{path}: expected a .jsonl (one JSON object per line) or .parquet file")
    rows = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            where = _where(path, line)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); expected one JSON object "
                                 f"per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got a {type(row).__name__}")
            rows.append((line, row))
    return rows


def _detect(row: dict) -> str | None:
    if {"prompt", "test", "entry_point"} <= row.keys():
        return "HumanEval"
    if "problem" in row and ("answer" in row or "solution" in row):
        return "MATH"
    if {"question", "answer"} <= row.keys():
        return "GSM8K"
    if "prompt" in row and not row.keys() & set(GOLD_FIELDS):
        return "prompt-only"
    return None


def _text(row: dict, field: str, *, required: bool = True) -> str | None:
    """row[field] as a non-empty string; None for an absent optional field. Raises _RowError otherwise."""
    value = row.get(field)
    if value is None:
        if required:
            raise _RowError(f"missing field {field!r} (fields: {sorted(row)})")
        return None
    if not isinstance(value, str):
        raise _RowError(f"field {field!r} must be a string, got {type(value).__name__} {str(value)[:50]!r}")
    if required and not value.strip():
        raise _RowError(f"field {field!r} is empty")
    return value


def _gsm8k_row(row: dict, _name: str) -> tuple[str, str]:
    question, answer = _text(row, "question"), _text(row, "answer")
    if "####" not in answer:
        raise _RowError("answer has no '#### <gold>' line (GSM8K's final answer)")
    # the rest of the last #### line: the gold; "1,600" -> "1600" as math-verify reads numbers without commas
    gold = answer.rsplit("####", 1)[1].split("\n", 1)[0].strip().replace(",", "")
    if not gold:
        raise _RowError("empty gold answer after '####'")
    return question, gold


def _math_row(row: dict, _name: str) -> tuple[str, str]:
    problem = _text(row, "problem")
    if row.get("answer") is not None:  # MATH-500: the final answer as its own field (a box in it is unwrapped)
        if not (gold := unbox(_text(row, "answer")).strip()):
            raise _RowError("empty gold answer: the answer field is an empty \\boxed{}")
        return problem, gold
    boxes = outer_boxes(_text(row, "solution"))
    if not boxes:
        raise _RowError("solution has no \\boxed{...} (MATH's final answer), or its last is left open, and there "
                        "is no answer field")
    if not boxes[-1].strip():
        raise _RowError("empty gold answer: the solution's last \\boxed{} is empty")
    return problem, boxes[-1].strip()


def _prompt_row(row: dict, _name: str) -> str:
    if gold := sorted(row.keys() & set(GOLD_FIELDS)):
        raise _RowError(f"has {', '.join(gold)}: a prompt-only file's rows carry no gold answer (choice 7)")
    return _text(row, "prompt")


def _humaneval_row(row: dict, name: str) -> CodeTask:
    prompt, test, entry_point = _text(row, "prompt"), _text(row, "test"), _text(row, "entry_point")
    if not entry_point.isidentifier():
        raise _RowError(f"entry_point {entry_point!r} is not a Python name")
    if not CHECK_RE.search(test):
        raise _RowError("test does not define check(candidate)")
    task_id = _text(row, "task_id", required=False) or name  # name: file:line, as unique as the row
    return CodeTask(task_id, prompt, test, entry_point, _text(row, "canonical_solution", required=False) or "")


# ----------------------------------------------------------------------------- a run's prompts

def load_tasks(cfg: TrainConfig) -> tuple[Task, Task]:
    """The training task and the held-out one: the dataset files (train_data, eval_data, every row read
    once), else reasoning-gym's tasks, held out by a seed far from the training one (and 4x eval_size
    of them, as some repeat a training question). Raises ValueError naming the field and the file, and for a
    prompt-only file (PromptTask) the setting that refuses it: a reward that reads golds (reward.rm_only off, or a
    judge), or sft_steps (nothing to imitate). The one check of prompt-only data, before any work."""
    if not cfg.train_data:
        return (TaskMix(cfg.tasks, seed=cfg.train_seed, size=cfg.train_size),
                TaskMix(cfg.tasks, seed=cfg.eval_seed, size=4 * cfg.eval_size))
    tasks = []
    for key in ("train_data", "eval_data"):
        path = getattr(cfg, key)
        if not os.path.exists(path):  # exists: a parquet dataset may be a folder
            raise ValueError(f"{key}={path!r}: no such file")
        try:
            # SFT draws training rows only
            tasks.append(load_task(path, sft_steps=cfg.sft_steps if key == "train_data" else 0))
        except (OSError, ValueError) as e:  # the message names the file and line
            raise ValueError(f"{key}={path!r}: {e}") from None
        if isinstance(tasks[-1], PromptTask) and cfg.reward.reads_gold:
            why = (f"reward.model={cfg.reward.model!r} is a judge, which compares each answer with the gold"
                   if cfg.reward.rm_only else "reward.rm_only=False: the verifier grades against each row's gold")
            raise ValueError(f"{key}={path!r}: prompt-only rows (no gold answer) need a reward that reads none, "
                             f"reward.rm_only=True with a scalar reward model; {why}")
        if isinstance(tasks[-1], PromptTask) and key == "train_data" and cfg.sft_steps:
            raise ValueError(f"{key}={path!r}: prompt-only rows have no answer for sft_steps={cfg.sft_steps} to "
                             f"imitate; set sft_steps=0")
    return tasks[0], tasks[1]


def prompt_ids(tok: Tokenizer, task: Task, item: Item, system: str = "", tools: list[dict] | None = None) -> list[int]:
    """An item's prompt as token ids: the task's wording of it, in the tokenizer's chat template (if any), with
    the schemas of the tools the rollout may call (tool_calls.tool_schemas; None: no tools)."""
    return tok.prompt_ids(task.user_message(item), system, tools=tools)


@dataclass
class Prompts:
    """The training prompts in one fixed random order, drawn in sequence and cycled (SFT and RL), each
    tokenized once, up front (`ids`, by question: the task's wording, in the chat template if the
    tokenizer has one). Prompts longer than max_tokens leave the order (`skipped` counts them); none
    left raises ValueError counting each cause (these, and the rows loading dropped: task.dropped) and giving the
    limit the shortest prompt needs."""
    task: Task  # reasoning-gym's TaskMix, or a dataset file's (load_task)
    order: list[int]  # a permutation of the task's items
    tok: Tokenizer
    max_tokens: int  # cfg.prompt_limit()
    system: str = ""  # cfg.system_prompt
    tools: list[dict] | None = None  # the schemas of cfg.tools (tool_calls.tool_schemas)
    used: int = 0  # items drawn so far: the data position a checkpoint saves
    ids: dict[str, list[int]] = field(init=False)  # question -> its prompt's token ids
    items: list[Item] = field(init=False)  # the task's prompts, in its own order
    skipped: int = field(init=False)

    def __post_init__(self):
        self.items, self.ids = [self.task[i] for i in range(len(self.task))], {}
        for it in self.items:
            if it.question not in self.ids:  # a question the task repeats is tokenized once
                self.ids[it.question] = prompt_ids(self.tok, self.task, it, self.system, self.tools)
        lengths = [len(self.ids[self.items[i].question]) for i in self.order]
        keep = [i for i, n in zip(self.order, lengths) if n <= self.max_tokens]
        self.skipped, self.order = len(self.order) - len(keep), keep
        if not keep:  # each cause counted: the rows loading dropped (task.dropped) and the prompts too long here
            shortest = min(lengths)
            drops = self.task.dropped()
            raise ValueError(f"all {self.skipped} training prompts are longer than max_prompt_tokens={self.max_tokens} "
                             f"(the shortest has {shortest} tokens){'; before that, ' + drops if drops else ''}: a "
                             f"prompt of {shortest} tokens fits with max_prompt_tokens >= {shortest} (0: all that fits) "
                             f"and model.max_seq_len - sampling.max_new_tokens >= {shortest}; or shorten the prompts")

    def draw(self, n: int) -> list[Item]:
        """The next n prompts; past the end the order starts over (a new epoch, in the same order)."""
        out = [self.items[self.order[(self.used + i) % len(self.order)]] for i in range(n)]
        self.used += n
        return out


# ----------------------------------------------------------------------------- what a run reads, once

@dataclass
class RunData:
    """A run's prompts and tokenizer, read (or learned) once before any work: the objects the run uses."""
    task: Task  # the training prompts' task (their verifier)
    held_out: Task  # the eval prompts' task
    tok: Tokenizer
    prompts: Prompts  # the training prompts, tokenized, in the run's order
    eval_items: list[Item]  # eval_size held-out items, unseen in training and within the prompt limit


def load_run_data(cfg: TrainConfig) -> RunData:
    """Tasks (`load_tasks`), tokenizer (`run_tokenizer`), the evals' prompts (`held_out_items`) and the
    training prompts tokenized in a fixed order seeded by cfg.seed. Raises ValueError naming the field
    (and file) of what is wrong."""
    task, held_out = load_tasks(cfg)
    tok = run_tokenizer(cfg, task)
    items = held_out_items(cfg, task, held_out, tok)
    # the data order from its own generator: it does not depend on what else draws from torch's RNG
    order = torch.randperm(len(task), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    try:
        prompts = Prompts(task, order, tok, cfg.prompt_limit(), cfg.system_prompt, tool_schemas(cfg.tools))
    except ValueError as e:  # none fits
        raise ValueError(f"max_prompt_tokens={cfg.max_prompt_tokens}: {e}") from None
    except Exception as e:  # noqa: BLE001  the checkpoint's chat template may raise jinja2's errors too
        raise ValueError(f"{'train_data' if cfg.train_data else 'tasks'}: a prompt does not render in the "
                         f"checkpoint's chat template ({type(e).__name__}: {e})") from None
    return RunData(task=task, held_out=held_out, tok=tok, prompts=prompts, eval_items=items)


def run_tokenizer(cfg: TrainConfig, task: Task) -> Tokenizer:
    """The checkpoint's tokenizer (init_hf, or init_from: an earlier run's), else the tiny demo's own BPE
    learned from the task's prompts and answers. Raises ValueError naming the field: a tokenizer that does
    not load, ids past model.vocab_size, bpe_merges too many, system_prompt without a chat template."""
    source = cfg.init_hf or cfg.init_from
    if source:
        key = "init_hf" if cfg.init_hf else "init_from"
        name = f"{key}={source!r}"
        try:
            tok = load_hf_tokenizer(source)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{name}: its tokenizer: {e}") from None
    else:
        name = "the demo BPE"
        try:  # it refuses more merges than the vocabulary holds beside the bytes and its specials, before training
            # with tools, each text also holds what every prompt shows and every call writes (tool_words)
            extra = "\n" + tool_words(cfg.tools, cfg.model.hf_model_type) if cfg.tools.enabled else ""
            tok = demo_tokenizer(train_tokenizer([it.question + "\n" + demonstration(it) + extra for it in task.items],
                                                 vocab_size=cfg.model.vocab_size, num_merges=cfg.bpe_merges),
                                 tools=bool(cfg.tools.enabled))
        except ValueError as e:
            raise ValueError(f"bpe_merges={cfg.bpe_merges}: the demo tokenizer's merges must fit model.vocab_size="
                             f"{cfg.model.vocab_size} ({e})") from None
    if tok.enc.n_vocab > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer of {name} has {tok.enc.n_vocab} ids; "
                         f"need at least as many embedding rows")
    if cfg.system_prompt and tok.chat_template is None:
        raise ValueError(f"system_prompt={cfg.system_prompt[:40]!r}: the tokenizer of {name} has no chat template to "
                         f"put it in")
    return tok


def held_out_items(cfg: TrainConfig, task: Task, held_out: Task, tok: Tokenizer) -> list[Item]:
    """The first eval_size held-out items no training prompt repeats (reasoning-gym repeats questions) and
    within the prompt limit. Raises ValueError naming eval_size when fewer are left."""
    unseen = held_out.exclude({it.question for it in task.items})
    source = f"eval_data={cfg.eval_data!r}" if cfg.eval_data else "reasoning-gym's held-out seed"
    if len(unseen) < cfg.eval_size:
        drops = f" ({held_out.dropped()})" if held_out.dropped() else ""
        raise ValueError(f"eval_size={cfg.eval_size}: {source} has {len(held_out)} usable rows{drops}, {len(unseen)} of "
                         f"them unseen in training; need at least eval_size")
    limit, items, schemas = cfg.prompt_limit(), [], tool_schemas(cfg.tools)
    for it in unseen:
        try:
            fits = len(prompt_ids(tok, held_out, it, cfg.system_prompt, schemas)) <= limit
        except Exception as e:  # noqa: BLE001  the checkpoint's chat template may raise jinja2's errors too
            raise ValueError(f"{source}: a prompt does not render in the checkpoint's chat template "
                             f"({type(e).__name__}: {e})") from None
        if fits:
            items.append(it)
            if len(items) == cfg.eval_size:
                return items
    raise ValueError(f"eval_size={cfg.eval_size}: only {len(items)} prompts of {source} unseen in training fit "
                     f"max_prompt_tokens={limit} (model.max_seq_len={cfg.model.max_seq_len} - "
                     f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} when 0); longer ones are skipped")
