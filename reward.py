"""Rewards: the tasks' verifiers, and the contract of the run's reward section.

Owns what decides a rollout's correctness: the binary verifiers (`reasoning_gym_reward` on
reasoning-gym's own scorers, `math_reward` on math-verify for GSM8K and MATH rows, the sandboxed
HumanEval-format `code_reward`; the tasks that call them, reasoning-gym's and a user's files,
are data.py's), the protocols a reward model and a pairwise judge implement (`RewardModel`,
`PairwiseJudge`: reward_model.py's checkpoints and stand-ins), and the run's `reward` section
(`RewardConfig`). How a verifier runs, under a time limit, inline or in a `RewardPool` beside
generation, is scoring.py's; how penalties and a scorer shape the verifier's reward without
advantage inversion is shaping.py's. Paper: HumanEval's task format (arXiv 2107.03374).

Verifiers (binary: 1.0 correct, 0.0 not):
1. reasoning-gym (`reasoning_gym_reward`, data.TaskMix's): each dataset's own `score_answer`,
   applied to the text inside the last `<answer>...</answer>`. Its partial credit (an answer
   that contains the gold answer scores len(gold)/len(answer)) is not a reward: only a score
   of 1.0 is.
2. math (`math_reward`): GSM8K and MATH rows, graded by math-verify. The answer is the
   last `<answer>` span, else the last `\\boxed{}`, else the rest of the line after the
   last `####`; only the last counts (several boxes inside the span too). Gold is parsed
   inside `$...$` and the answer inside `\\boxed{}` (math-verify cuts undelimited LaTeX to
   a number), where a list of candidates ("3, 4, 5", "4 \\text{ or } 5") is a set that a
   single gold value does not equal; if that does not match, an answer with exactly one
   number in prose is read as that number ("18 eggs" -> 18; "3 4 5 eggs" has no reading).
   math-verify can hang (9^{9^{9^{9}}}), so `math_equal` keeps a limit of its own: the
   caller's, else MATH_TIMEOUT_S; on the main thread by scoring.time_limited's signal,
   elsewhere in scoring.grade_elsewhere's grader process (scoring.py's docstring says why).
3. code (`code_reward`): a HumanEval-format problem (data.CodeTask: prompt, test defining
   `check(candidate)`, entry point); the completion runs in `sandbox.run`, its tests apart
   from it (`sandbox.Check`), so only plain data, never a rigged object, reaches them.
4. Every parse of a completion here runs in time linear in its length: no pattern backtracks over
   overlapping choices (PROSE_RE's runs of letters are possessive), and the tags and nested boxes
   are read by one pass of str.find (`answer_spans`, `unbox`), so no crafted answer costs the
   scoring time limit (tests/test_break_verifier_time.py times each on crafted inputs).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import sandbox
from rules import FLAG, NON_NEGATIVE, POSITIVE, check_fields, integer, number, text as text_rule
from scoring import ScoreTimeout, grade_elsewhere, time_limited

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"  # the tags around an answer (answer_spans)
CODE_BLOCK_RE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)  # a fence tagged python, py or untagged
CORRECT_SCORE = 1.0  # reasoning-gym's score for an exact answer; anything less is partial credit
PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")  # a plain number: math-verify surely reads it
MATH_TIMEOUT_S = 5.0  # a math_equal call's limit when its caller sets none (scoring.RewardPool and score_inline do)
JUDGE_OUTCOMES = {"better": 1.0, "tie": 0.5, "worse": 0.0}  # P(completion beats the reference)


def answer_spans(text: str) -> list[str]:
    """The text inside each <answer>...</answer> of text, in order, across lines: each opening tag with the first
    closing tag after it, as re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL) reads them. Callers take the
    last, so a model that drafts an answer and then corrects itself is graded on its final one.

    Linear in len(text) (str.find, each character passed once), where that regex rescans the rest of the text
    from every opening tag with no closing one after it: quadratic in a completion of repeated "<answer>"."""
    spans, i = [], 0
    while (start := text.find(ANSWER_OPEN, i)) >= 0:
        end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if end < 0:  # no closing tag after this opening one, so none after any later one either
            break
        spans.append(text[start + len(ANSWER_OPEN):end])
        i = end + len(ANSWER_CLOSE)
    return spans


def reasoning_gym_reward(completion: str, dataset, entry: dict) -> float:
    """Binary reward of a reasoning-gym item: 1.0 iff the dataset's own scorer gives the last <answer> span
    full marks (its partial credit would pay a verbose answer that merely contains the gold one)."""
    found = answer_spans(completion)
    if not found:
        return 0.0
    # the dataset's own scorer, given the whole entry: it may read the entry's metadata and accept more
    # than one form of the answer
    return 1.0 if dataset.score_answer(found[-1].strip(), entry) >= CORRECT_SCORE else 0.0


# ----------------------------------------------------------------------------- math

def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, braces balanced; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")  # i: the opening brace
    # count braces rather than match a regex up to "}": answers such as \frac{1}{2} nest them
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: last <answer> span, else last \\boxed{}, else after the last '####'.

    Only the last one counts: an <answer> span that holds several \\boxed{} is read as its last.
    """
    # the tag the prompt asks for first, then MATH's \boxed{} convention, then GSM8K's "#### n" line
    if found := answer_spans(text):
        span = found[-1]
        # "<answer>\boxed{3} or \boxed{4}</answer>" lists candidates; as anywhere else, the last box is the answer
        return (last_boxed(span) if "\\boxed{" in span else span).strip()
    if (boxed := last_boxed(text)) is not None:
        return boxed.strip()
    if "####" in text:  # only the rest of that line: an explanation may follow the number
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    return None


# A number as the plain-text fallback reads it: sign, digits (thousands commas allowed), decimals; a token of its
# own, not part of a name or of another number ("x-5" holds 5, not -5; "2ab" holds none)
NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)")
# What may surround that number: words (units, "the answer is"), currency and percent signs, punctuation;
# no operator, bracket, backslash or lone letter (a variable: "2x", "4\pi" are not 2 and 4). Possessive (`{2,}+`,
# `*+`): a run of letters is taken whole, once. Backtracking `{2,}|[aAI]` would try every way to split a run of
# "a"s into words and single letters before failing at a bracket: exponential ("a" * 28 + "(" took the whole
# scoring timeout); taken whole, a run splits one way, and a fullmatch is one pass
PROSE_RE = re.compile(r"(?:[A-Za-z]{2,}+|[aAI]|[\s$%€£.,:;!?'\"-])*+")


def math_gold_readable(gold: str) -> bool:
    """Whether math-verify reads a gold answer as an expression, delimited as math_equal reads it; bounded
    by MATH_TIMEOUT_S. Not readable: nothing parses, so only an answer of the very same text could match."""
    if PLAIN_NUMBER_RE.fullmatch(gold):  # surely readable: no need to parse it
        return True
    from math_verify import parse
    try:  # no_fallback: without it parse returns the text itself when it reads no expression
        return bool(time_limited(lambda: parse(f"${gold}$", parsing_timeout=None, fallback_mode="no_fallback"),
                                 seconds=MATH_TIMEOUT_S))
    except ScoreTimeout:
        return False


def math_equal(answer: str, gold: str) -> bool:
    """Whether math-verify finds `answer` equal to `gold` (both LaTeX or plain text).

    An answer that lists candidates never matches a single gold value: LaTeX is read
    whole, where "3, 4, 5", "4 \\text{ or } 5" or "4 \\pm 1" are sets of several values;
    the plain-text fallback ("18 eggs" -> 18) takes only an answer with exactly one number
    in prose around it. A gold that is itself a set or tuple matches its own answer.
    Time-limited (see scoring.time_limited): on the main thread by a signal, elsewhere by
    running in a grader process, to the caller's limit or else MATH_TIMEOUT_S; raises
    scoring.ScoreTimeout when it runs out.
    """
    if threading.current_thread() is threading.main_thread():
        return time_limited(_math_equal_here, answer, gold, seconds=MATH_TIMEOUT_S)  # an enclosing limit governs
    # Off the main thread no signal can interrupt math-verify, and CPython's big-integer power (a huge
    # exponent such as 9^{9^{9^{9}}}) holds the GIL for minutes: every thread of this process, the
    # pool's watchdog too, would stop. In a grader process it can be killed.
    return grade_elsewhere(_math_equal_here, answer, gold, default_s=MATH_TIMEOUT_S)


def _math_equal_here(answer: str, gold: str) -> bool:
    """math_equal's work, in this process, with no limit of its own (a grader process runs it too)."""
    from math_verify import parse, verify  # imports sympy: paid on first use, not on import of this file
    # math-verify warns that its own timeouts are off: they are, on purpose; time_limited bounds the call instead
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # None turns math-verify's own timeouts off: they use signal.alarm, the timer time_limited uses
    # delimited, so a LaTeX gold such as \frac{1}{2} is read whole (undelimited LaTeX is cut to a number)
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    if not gold_parsed:  # a gold answer math-verify cannot read: no completion can match it
        return False
    # first_match: the box is read whole or not at all. By default math-verify tries match after match until one
    # parses, so "3 \lor 4" or "\begin{cases} 3 \\ 4 \end{cases}", which its LaTeX reader cannot take,
    # would be read as their last number
    parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None, extraction_mode="first_match")
    # gold first: math-verify's verify is not symmetric (the first argument is the reference)
    if parsed and verify(gold_parsed, parsed, timeout_seconds=None):
        return True
    # Plain text: math-verify's plain-text parse picks one number out of any text ("3 or 4" -> 3 or 4,
    # whichever it finds), so only an answer with exactly one number, in prose, gets this second reading.
    numbers = NUMBER_RE.findall(answer)
    if len(numbers) != 1 or not PROSE_RE.fullmatch(NUMBER_RE.sub(" ", answer)):
        return False
    parsed = parse(f"${numbers[0].replace(',', '')}$", parsing_timeout=None)
    return bool(parsed) and verify(gold_parsed, parsed, timeout_seconds=None)


# one answer, one value: the strict reading of a completion's final answer (and of a MATH gold's box)

BOX = "\\boxed{"
BRACE_RE = re.compile(r"[{}]")
# A relation between values: "=" (not inside "<=", ">=", "!=", "==", ":="), \equiv, \approx. math-verify grades
# "17 = 18" by its right side and "18 \approx 17" by its left: a chain holds a value it is not graded on
RELATION_RE = re.compile(r"(?<![<>!=:])=(?!=)|\\(?:equiv|approx)(?![A-Za-z])")
OR_RE = re.compile(r"\bor\b|\\(?:lor|vee)(?![A-Za-z])", re.IGNORECASE)  # "4 or 5", "\text{ (or 17)}", "4 \lor 5"
DIGIT_SUBSCRIPT_RE = re.compile(r"\d\}?\s*_")  # "18_{17}", which math-verify reads as 18; a base where the gold has one
TEXT_RE = re.compile(r"\\(?:text[a-z]*|mathrm|mbox)\s*\{")  # prose inside math, which math-verify drops unread
SUBSCRIPT_RE = re.compile(r"_(?:\{[^{}]*\}|\w)")  # "x_{17}": an index, not a value
CONSTANT_RE = re.compile(r"\s*(?:e|i|\\pi|\\infty)\s*")  # letters that are values, not names of one


def _closing_brace(text: str, i: int) -> int | None:
    """Index of the brace that closes the one at text[i], or None if it is left open."""
    depth = 0
    # every brace counts, "\{" too, as in last_boxed: a set "\{1, 2\}" opens and closes one each
    for m in BRACE_RE.finditer(text, i):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def _box_spans(text: str) -> list[tuple[int, int | None]]:
    """(start of "\\boxed{", index of its closing brace) of each outermost box; a last one left open has None."""
    spans, i = [], 0
    while (start := text.find(BOX, i)) >= 0:
        end = _closing_brace(text, start + len(BOX) - 1)
        spans.append((start, end))
        if end is None:  # the rest of the text is inside it
            break
        i = end + 1
    return spans


def unbox(text: str) -> str:
    """text with each balanced \\boxed{X} replaced by X, a box in a box too; a box left open stays as it is, and so
    does the rest of the text after it (inside it).

    One pass, linear in len(text): each brace paired once (a box inside a balanced box is balanced, so only a box
    at the top can be left open), where unwrapping box by box rescans each nested box's contents, quadratic in
    the depth, and recursion ends at Python's limit (~1000 boxes deep)."""
    closing, depth = {}, []  # index of each "{" -> index of its "}"; the "{"s still open
    for m in BRACE_RE.finditer(text):
        if m.group() == "{":
            depth.append(m.start())
        elif depth:  # a "}" with none open closes nothing, as _closing_brace counts
            closing[depth.pop()] = m.start()
    cuts, i = [], 0  # (index, length) of each "\\boxed{" and its "}" to leave out
    while (start := text.find(BOX, i)) >= 0:
        end = closing.get(start + len(BOX) - 1)
        if end is None:
            break
        cuts += [(start, len(BOX)), (end, 1)]
        i = start + len(BOX)  # the boxes inside it are next
    out, i = [], 0
    for at, n in sorted(cuts):
        out.append(text[i:at])
        i = at + n
    return "".join(out) + text[i:]


def outer_boxes(text: str) -> list[str] | None:
    """The contents of each outermost \\boxed{...} of text, in order, with the boxes inside it unwrapped; None if
    the last box is left open (a truncated text). A box is one answer however it nests: in
    "\\boxed{\\frac{\\boxed{1}}{2}}" it is \\frac{1}{2}, where last_boxed finds 1."""
    spans = _box_spans(text)
    if spans and spans[-1][1] is None:
        return None
    return [unbox(text[start + len(BOX):end]) for start, end in spans]


def _names_a_value(lhs: str) -> bool:
    """Whether the left side of "lhs = value" names the value ("x", "x_{17}", "f(x)", "a + b") rather than being one."""
    bare = SUBSCRIPT_RE.sub("", lhs)
    return bool(bare.strip()) and not re.search(r"\d", bare) and not CONSTANT_RE.fullmatch(bare)


def _prose_values(text: str) -> tuple[int, bool]:
    """(values the text holds if its \\text{} groups are prose: each number in them, and one for the maths around
    them if it has a digit; whether a group holds a lone bracket, "18 \\text{(}17\\text{)}")."""
    numbers, outside, unpaired, i = 0, [], False, 0
    while m := TEXT_RE.search(text, i):
        end = _closing_brace(text, m.end() - 1)
        if end is None:
            break
        prose = text[m.end():end]
        numbers += len(NUMBER_RE.findall(prose))
        unpaired |= prose.count("(") != prose.count(")")
        outside.append(text[i:m.start()])
        i = end + 1
    return numbers + bool(re.search(r"\d", "".join(outside) + text[i:])), unpaired


def several_values(answer: str, gold: str) -> str | None:
    """Why `answer` holds more than one candidate value, or None if it holds at most one.

    Each rule counts a form the gold does not have itself (an equation, "or", a base's
    subscript, numbers in prose), so a gold passes as its own answer. A list ("3, 4") is
    left to math-verify, which reads it as a set that a single value does not equal, and so
    is "1,000": one number.
    """
    relations = len(RELATION_RE.findall(answer))
    if relations > len(RELATION_RE.findall(gold)):
        # "x = 5" names its value; "17 = 18", "x = 17 = 18" and (gold "y = 2x + 1") "y = 2x + 1 = 3" chain two
        if relations > 1 or not _names_a_value(RELATION_RE.split(answer, 1)[0]):
            return "a chain of relations"
    if len(OR_RE.findall(answer)) > len(OR_RE.findall(gold)):
        return "alternatives joined by 'or'"
    if DIGIT_SUBSCRIPT_RE.search(answer) and not DIGIT_SUBSCRIPT_RE.search(gold):
        return "a number with a subscript"
    (numbers, unpaired), (gold_numbers, gold_unpaired) = _prose_values(answer), _prose_values(gold)
    if numbers > max(1, gold_numbers) or (unpaired and not gold_unpaired):
        return "a second value in prose"
    return None


def final_answer(completion: str, gold: str) -> str | None:
    """The one final answer of a math completion, or None when it has none or more than one candidate (reward 0).

    Its last <answer> span, else the whole completion, holds the boxes (outer_boxes); they
    must agree, whitespace aside (two forms of one value, "\\frac12" and "0.5", are two
    candidates: telling them equal would take a math-verify call). Without a box, the span
    or the line after the last '####' is the answer, as extract_answer reads it. An
    answer that holds several values (several_values, against `gold`) is None too.
    """
    spans = answer_spans(completion)
    boxes = outer_boxes(spans[-1] if spans else completion)
    if boxes is None:  # cut off inside its last box
        return None
    if boxes:
        found = {re.sub(r"\s+", "", b): b.strip() for b in boxes}  # told apart by their text
        found.pop("", None)  # an empty box ("I will put it in \boxed{}", echoing the instruction) holds no candidate
        if len(found) != 1:
            return None
        answer = found.popitem()[1]
    else:
        answer = extract_answer(completion)
    return answer if answer and several_values(answer, gold) is None else None


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's one final answer (final_answer: none where it offers several candidates) equals gold
    under math-verify, else 0.0.

    Raises scoring.ScoreTimeout when math-verify runs out of time (see math_equal).
    """
    answer = final_answer(completion, gold)
    return 1.0 if answer and math_equal(answer, gold) else 0.0


# ----------------------------------------------------------------------------- code

class CodeProblem(Protocol):
    """What the code verifier reads of a HumanEval-format problem (data.CodeTask is one)."""
    prompt: str  # imports, the signature and the docstring
    test: str  # defines check(candidate), which asserts on entry_point
    entry_point: str


def code_solution(completion: str, task: CodeProblem) -> str:
    """The program the completion stands for: the prompt and the completion's code.

    The code is the last ```python block, else the <answer> span, else the whole completion.
    A completion that defines entry_point itself follows the prompt (the prompt's function,
    a docstring only, is then redefined); otherwise it is the body that continues the prompt.
    """
    blocks = CODE_BLOCK_RE.findall(completion)
    code = blocks[-1] if blocks else (answer_spans(completion) or [completion])[-1]
    # HumanEval's completions are function bodies that continue the prompt, which ends inside the function;
    # chat models tend to write the whole function again instead. Both layouts must run.
    defines = re.search(rf"^def {re.escape(task.entry_point)}\s*\(", code, re.MULTILINE)
    return f"{task.prompt}\n{code}" if defines else task.prompt + code


def code_reward(completion: str, task: CodeProblem) -> float:
    """1.0 if the completion passes the task's tests inside the sandbox (sandbox.SandboxLimits' defaults), else 0.0
    (a timeout included).

    The tests run apart from the completion's code (sandbox.Check): only plain data crosses
    between them, so a value rigged to equal anything, a redefined check or builtin, an
    early exit or a printed pass marker earns nothing (sandbox.py's docstring).
    """
    # the prompt goes with the tests too: HumanEval's tests call its helpers (encode_cyclic for decode_cyclic),
    # and the completion's own versions of them must not be the ones the tests trust
    check = sandbox.Check(task.test, task.entry_point, context=task.prompt)
    return 1.0 if sandbox.run(code_solution(completion, task), check=check).passed else 0.0


# ----------------------------------------------------------------------------- reward models

@runtime_checkable
class RewardModel(Protocol):
    """A scalar reward model: one unbounded score per (prompt, completion); higher is better. NaN is no score, for a
    pair the model cannot read (reward_model.HFRewardModel: a conversation past its context): it shapes nothing
    (shaping.rm_score) and is counted (rm/unscored); a model whose own forward is not finite raises instead.

    sharded: whether `score` is a collective (reward.rm_shard: the model FSDP-sharded over every rank, each rank
    calling it once per step with its own rows, none too; shaping.py's choice 4), else each rank's is its own."""
    sharded: bool

    def score(self, prompts: list[str], completions: list[str]) -> list[float]: ...


@runtime_checkable
class PairwiseJudge(Protocol):
    """A judge of completion against reference: P(completion is better), 1.0 / 0.5 / 0.0 for Better / Tie / Worse.

    counts: what its calls counted since the caller last reset them, {name: count} (a generative judge's
    unparsed replies, say; logged as judge/<name>, summed over ranks); empty for a judge that counts nothing."""
    counts: Counter

    def compare(self, prompts: list[str], completions: list[str], references: list[str]) -> list[float]: ...


Scorer = RewardModel | PairwiseJudge
"""The run's scorer (reward.model), a reward model or a pairwise judge: told apart by
`isinstance(scorer, PairwiseJudge)` (both protocols are runtime-checkable, each member declared)."""


REWARD_MODELS = ("", "stub", "stub-judge")  # the built-in scorers; reward.model may instead name a checkpoint folder
JUDGE_PREFIX = "judge:"  # reward.model=judge:<folder>: a causal LM as a judge (reward_model.GenerativeJudge)


@dataclass(frozen=True)
class RewardConfig:
    """How rewards are shaped inside the correctness class (shaping.adjust_rewards: no advantage inversion) and
    scored: the run's `reward` section. Raises ValueError on a field its rule refuses (`RULES`)."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: tokens before sampling.max_new_tokens where it ramps from 0 to -1 (0 = off)."""
    repetition_weight: float = 0.0
    """Weight of the repeated-4-gram penalty in the shaping score (0 = off)."""
    tool_failure_weight: float = 0.0
    """Weight of the failed-call penalty in the shaping score: minus the share of a row's tool calls that failed
    (malformed, refused, timed out or erroring: tool_calls.FAILURES), 0 for a row without calls (0 = off)."""
    model: str = ""
    """Scorer mixed into the shaping score: '' (none), 'stub' (a reward model of deterministic noise), 'stub-judge'
    (a pairwise judge against the gold answer; both stand-ins test the wiring), the path of a reward model's
    checkpoint folder (a transformers sequence-classification checkpoint: reward_model.HFRewardModel), or
    'judge:<folder>', a causal LM's checkpoint that judges each completion against the gold answer
    (reward_model.GenerativeJudge, greedy on the native engine)."""
    rm_batch_size: int = 8
    """(prompt, completion) pairs per forward of a checkpoint folder's reward model."""
    rm_weight: float = 0.5
    """Weight of the reward model's (or judge's) score in the shaping score. 0 with rm_only is refused (the reward
    would be the penalties alone, or identically 0); 0 otherwise scores and logs it (rm/score_mean) without shaping
    by it, said at start."""
    judge_dead_band: float = 0.1
    """Judge verdicts within this of 1/2 count as ties and add exactly nothing (shaping.judge_score)."""
    judge_max_new_tokens: int = 512
    """A generative judge's reply limit, in tokens: a reply cut off there has no last verdict line (a counted tie)."""
    rm_shard: bool = False
    """Under torchrun, a checkpoint folder's reward model FSDP-sharded over every rank (each holds 1/world of its
    weights, a block gathered at a time as it scores: reward_model.HFRewardModel's choice 9), instead of a whole copy
    on every rank. Scoring is then collective: one call per step after generation, every rank running as many
    forwards (reward workers do not overlap it). A scalar reward model only; one process: a whole copy anyway."""
    rm_only: bool = False
    """The reward is the shaping score alone (reward model or judge, and penalties), the verifier's correctness
    unread: RL on prompts without trusted gold answers. Every response is then in one correctness class, so
    shaping.adjust_rewards' ordering guarantee holds vacuously. Needs reward.model (config.RELATIONS, but for a dry run) and
    rm_weight > 0.
    With a scalar reward model (not a judge) the run may read prompt-only data (`reads_gold`, data.PromptTask)."""
    shaping_margin: float = 0.4
    """Shaping scale m < 1/2 in r = correct + m min(p, 1 - p) s."""
    workers: int = 0
    """Threads that score rollouts while generation goes on (0 = score inline after generating)."""
    timeout_s: float = 30.0
    """Per-rollout scoring limit; a timeout or an exception gives reward 0, counted in the metrics."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "overlong_buffer": integer(0, why="0 = off; at most sampling.max_new_tokens"),
        "repetition_weight": number(0, why="a penalty's weight; a negative one would pay for repeats"),
        "tool_failure_weight": number(0, why="a penalty's weight; a negative one would pay for failed calls"),
        "model": text_rule(f"one of {', '.join(map(repr, REWARD_MODELS))}, or a reward model's checkpoint folder "
                           f"(an existing directory) or '{JUDGE_PREFIX}<folder>' (a causal LM's, as a judge)",
                           lambda v: v in REWARD_MODELS or os.path.isdir(v.removeprefix(JUDGE_PREFIX))),
        "rm_batch_size": integer(1),
        "rm_weight": NON_NEGATIVE,
        "judge_dead_band": number(0, 0.5, high_open=True),
        "judge_max_new_tokens": integer(1),
        "rm_only": FLAG,
        "rm_shard": FLAG,
        "shaping_margin": number(0, 0.5, high_open=True, why="at 1/2 a correct answer could get a negative advantage"),
        "workers": integer(0),
        "timeout_s": POSITIVE,
    }

    def __post_init__(self):
        check_fields(self)
        if self.rm_only and self.rm_weight == 0:  # clamp(0 * score + penalties): nothing of the scorer, often 0
            raise ValueError(f"rm_weight=0.0 with rm_only=True: the reward is rm_weight times the scorer's score (plus "
                             f"the penalties), so it would never read the reward model; set rm_weight > 0 (the recipe "
                             f"configs/qwen3_30b_a3b_rm.py uses 1.0) or rm_only=False")
        if self.rm_weight == 0 and self.model and not self.rm_only:
            warnings.warn(f"reward.rm_weight=0.0: reward.model={self.model!r} is loaded and its outputs logged "
                          f"(rm/score_mean or judge/p_better_mean) but shape no reward")
        if self.rm_shard and self.model and (self.model in REWARD_MODELS or self.judges):  # '': a recipe's, to be set
            raise ValueError(f"rm_shard=True shards a reward model's checkpoint folder; model={self.model!r} is "
                             f"{'a judge' if self.judges else 'a stand-in'}: set model to a sequence classifier's "
                             "folder or leave rm_shard False")

    @property
    def shapes(self) -> bool:
        """Whether any shaping applies (otherwise the reward is the correctness itself)."""
        return bool(self.overlong_buffer or self.repetition_weight or self.tool_failure_weight or self.model
                    or self.rm_only)

    @property
    def judges(self) -> bool:
        """Whether the scorer is a pairwise judge ('stub-judge', 'judge:<folder>') rather than a reward model."""
        return self.model == "stub-judge" or self.model.startswith(JUDGE_PREFIX)

    @property
    def reads_gold(self) -> bool:
        """Whether the reward reads each row's gold answer: the verifier's correctness (unless rm_only), or a
        judge's reference. Prompt-only rows (data.PromptTask) need it False."""
        return not self.rm_only or self.judges
