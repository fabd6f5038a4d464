"""Rewards: verifiers, penalties, reward-model adjustment without advantage inversion, overlapped scoring.

Owns every reward an RL step sees: the binary verifiers (reasoning-gym's `TaskMix`,
`math_reward` on math-verify for GSM8K and MATH rows, the sandboxed HumanEval-format
`code_reward`; data.py makes a user's files into tasks that use them), DAPO's overlong
penalty and a repetition penalty, reward-model and pairwise judge shaping
(`shaped_rewards`, through `adjust_rewards`, which keeps every correct response's reward
above every wrong one's), `RewardPool`, which scores rollouts while generation goes on,
and the time limits that keep every verifier from hanging. Papers: DAPO (arXiv 2503.14476), its soft overlong punishment (eq. 13);
HumanEval's task format (arXiv 2107.03374); the group-relative advantage of GRPO (arXiv
2402.03300), whose sign the shaping must never turn against correctness.

Shapes: P, G (letters of the README's legend).

Verifiers (binary: 1.0 correct, 0.0 not):
1. reasoning-gym (`TaskMix`): a mix of procedurally generated datasets, each with its own
   `score_answer`, applied to the text inside the last `<answer>...</answer>`. Its partial
   credit (an answer that contains the gold answer scores len(gold)/len(answer)) is not a
   reward: only a score of 1.0 is. Seeds: item i of seed s equals item i-1 of seed s+1, so
   train and eval seeds must lie further apart than the train size; `exclude` drops eval
   items whose question also appears in training.
2. math (`math_reward`): GSM8K and MATH rows, graded by math-verify. The answer is the
   last `<answer>` span, else the last `\\boxed{}`, else the rest of the line after the
   last `####`; only the last counts (several boxes inside the span too). Gold is parsed
   inside `$...$` and the answer inside `\\boxed{}` (math-verify cuts undelimited LaTeX to
   a number), where a list of candidates ("3, 4, 5", "4 \\text{ or } 5") is a set that a
   single gold value does not equal; if that does not match, an answer with exactly one
   number in prose is read as that number ("18 eggs" -> 18; "3 4 5 eggs" has no reading).
3. code (`CodeTask`, `code_reward`): a HumanEval-format task (prompt, test defining
   `check(candidate)`, entry point); the completion runs in `sandbox.run`, its tests apart
   from it (`sandbox.Check`), so only plain data, never a rigged object, reaches them.

Penalties and shaping:
1. Penalties, in [-1, 0]: DAPO's soft overlong punishment (eq. 13) and a repetition
   penalty (the fraction of repeated n-grams).
2. Adjustment (`adjust_rewards`): a shaping score s in [-1, 1] (a reward-model or judge
   score, penalties) is added inside the correctness class,
   r_i = c_i + m * min(p, 1 - p) * s_i, with c_i in {0, 1}, p the group's fraction
   correct and m < 1/2. Since |s_i - mean(s)| <= 2, in a group with 0 < p < 1 every
   correct response keeps r_i > mean(r) and every wrong one r_i < mean(r): the
   group-relative advantage never changes sign against correctness (no advantage
   inversion), and any correct response's reward stays above any wrong one's.
3. A group with p in {0, 1} gets no shaping, so it stays zero-variance (the filter decides
   its fate).
4. Pairwise judge outcomes map to s with a dead band (`judge_score`), so a tie adds
   exactly zero.
5. Departure from DAPO: its overlong penalty is added to a +-1 reward, where an overlong
   correct answer can fall below a wrong one; here penalties enter as shaping instead.

Overlapped scoring (`RewardPool`): workers score rollouts while the caller keeps
generating; each item has a timeout; an exception, a non-finite value or a timeout gives
reward 0 with the reason counted, and every submitted key gets a reward. Without a pool,
`score_inline` gives the same (reward, reason) on the calling thread.

Time limits (`time_limited`): a verifier that hangs (math-verify on 9^{9^{9^{9}}}) is cut
off in every mode. On the main thread (inline scoring, a process-pool worker, a grader) a
SIGALRM timer interrupts it; a thread cannot be interrupted, and CPython's big-integer
power holds the GIL, stopping every thread, so off the main thread math_equal runs
math-verify in a grader process that is killed if it overruns. A verifier's own limit
raises `ScoreTimeout`, which the pool and score_inline count as "timeout".
"""

from __future__ import annotations

import functools
import hashlib
import math
import multiprocessing
import queue
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

import sandbox

# non-greedy and across lines; callers take the last match, so a model that drafts an answer and then corrects
# itself is graded on its final one
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
CODE_BLOCK_RE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)  # a fence tagged python, py or untagged
CORRECT_SCORE = 1.0  # reasoning-gym's score for an exact answer; anything less is partial credit
MATH_TIMEOUT_S = 5.0  # a math_equal call's limit when its caller sets none (RewardPool and score_inline do)
JUDGE_OUTCOMES = {"better": 1.0, "tie": 0.5, "worse": 0.0}  # P(completion beats the reference)


@dataclass(frozen=True)
class Item:
    question: str
    answer: str
    task: int  # index into the mix's datasets
    index: int  # index within that dataset


class ItemList:
    """A task's prompts as a list of Item (`self.items`), indexable, with eval de-duplication.

    A task (TaskMix here; data.MathTask and data.HumanEvalTask for a user's files) also has
    score(completion, item) -> float (binary, may raise ScoreTimeout), user_message(item)
    -> str (the prompt's text for a chat model) and demonstration(item) -> str (an SFT target).
    """
    items: list[Item]

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


class TaskMix(ItemList):
    """Round-robin mix of reasoning-gym datasets: item i comes from dataset i % num_tasks.

    specs: list of (dataset name, kwargs) for `reasoning_gym.create_dataset`.
    Raises ValueError on an empty spec list or an unknown dataset name.
    """

    def __init__(self, specs: list[tuple[str, dict]], *, seed: int, size: int):
        import reasoning_gym  # here, not at the top: config.py and the GPU check import this file without it
        if not specs:
            raise ValueError("TaskMix needs at least one (name, kwargs) spec")
        per_task = -(-size // len(specs))  # ceil: each dataset holds at least its round-robin share
        self.datasets = []
        for name, kwargs in specs:
            try:
                self.datasets.append(reasoning_gym.create_dataset(name, seed=seed, size=per_task, **kwargs))
            except KeyError as e:  # reasoning-gym's error for an unknown name; a config error is a ValueError here
                raise ValueError(f"unknown reasoning-gym dataset {name!r}") from e
        self.items = []
        # round robin, so any prefix of the items (a smaller size, the first steps' prompts) holds every
        # dataset in equal share
        for i in range(size):
            t, j = i % len(specs), i // len(specs)
            entry = self.datasets[t][j]
            self.items.append(Item(entry["question"], str(entry["answer"]), t, j))  # a dataset's gold may be a number

    def score(self, completion: str, item: Item) -> float:
        """Binary reward: 1.0 iff the scorer gives the last <answer> span full marks."""
        found = ANSWER_RE.findall(completion)
        if not found:
            return 0.0
        ds = self.datasets[item.task]
        # the dataset's own scorer, given the whole entry: it may read the entry's metadata and accept more
        # than one form of the answer
        score = ds.score_answer(found[-1].strip(), ds[item.index])
        # not the score itself: partial credit would pay a verbose answer that merely contains the gold one
        return 1.0 if score >= CORRECT_SCORE else 0.0

    def demonstration(self, item: Item) -> str:
        return demonstration(item)


def demonstration(item: Item) -> str:
    """The completion an SFT warm-up imitates on a TaskMix: the gold answer in answer tags."""
    return f"<answer>{item.answer}</answer>"


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
    if found := ANSWER_RE.findall(text):
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
# no operator, bracket, backslash or lone letter (a variable: "2x", "4\pi" are not 2 and 4)
PROSE_RE = re.compile(r"(?:[A-Za-z]{2,}|[aAI]|[\s$%€£.,:;!?'\"-])*")


def math_equal(answer: str, gold: str) -> bool:
    """Whether math-verify finds `answer` equal to `gold` (both LaTeX or plain text).

    An answer that lists candidates never matches a single gold value: LaTeX is read
    whole, where "3, 4, 5", "4 \\text{ or } 5" or "4 \\pm 1" are sets of several values;
    the plain-text fallback ("18 eggs" -> 18) takes only an answer with exactly one number
    in prose around it. A gold that is itself a set or tuple matches its own answer.
    Time-limited (see time_limited): on the main thread by a signal, elsewhere by running
    in a grader process, to the caller's limit or else MATH_TIMEOUT_S; raises ScoreTimeout
    when it runs out.
    """
    if threading.current_thread() is threading.main_thread():
        return time_limited(_math_equal_here, answer, gold, seconds=MATH_TIMEOUT_S)  # an enclosing limit governs
    # Off the main thread no signal can interrupt math-verify, and CPython's big-integer power (a huge
    # exponent such as 9^{9^{9^{9}}}) holds the GIL for minutes: every thread of this process, the
    # pool's watchdog too, would stop. In a grader process it can be killed.
    return _grade_elsewhere(answer, gold)


def _math_equal_here(answer: str, gold: str) -> bool:
    """math_equal's work, in this process, with no limit of its own."""
    from math_verify import parse, verify  # imports sympy: paid on first use, not on import of this file
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


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer (see extract_answer) equals gold under math-verify, else 0.0.

    Raises ScoreTimeout when math-verify runs out of time (see math_equal).
    """
    answer = extract_answer(completion)
    return 1.0 if answer and math_equal(answer, gold) else 0.0


# ----------------------------------------------------------------------------- code

@dataclass(frozen=True)
class CodeTask:
    """A HumanEval-format task: `test` defines check(candidate), which asserts on entry_point."""
    task_id: str
    prompt: str  # imports, the signature and the docstring
    test: str
    entry_point: str
    canonical_solution: str = ""  # the reference body that continues the prompt ("" if the data has none)


def code_solution(completion: str, task: CodeTask) -> str:
    """The program the completion stands for: the prompt and the completion's code.

    The code is the last ```python block, else the <answer> span, else the whole completion.
    A completion that defines entry_point itself follows the prompt (the prompt's function,
    a docstring only, is then redefined); otherwise it is the body that continues the prompt.
    """
    blocks = CODE_BLOCK_RE.findall(completion)
    code = blocks[-1] if blocks else (ANSWER_RE.findall(completion) or [completion])[-1]
    # HumanEval's completions are function bodies that continue the prompt, which ends inside the function;
    # chat models tend to write the whole function again instead. Both layouts must run.
    defines = re.search(rf"^def {re.escape(task.entry_point)}\s*\(", code, re.MULTILINE)
    return f"{task.prompt}\n{code}" if defines else task.prompt + code


def code_reward(completion: str, task: CodeTask, *, limits: sandbox.SandboxLimits = sandbox.SandboxLimits()) -> float:
    """1.0 if the completion passes the task's tests inside the sandbox, else 0.0 (a timeout included).

    The tests run apart from the completion's code (sandbox.Check): only plain data crosses
    between them, so a value rigged to equal anything, a redefined check or builtin, an
    early exit or a printed pass marker earns nothing (sandbox.py's docstring).
    """
    # the prompt goes with the tests too: HumanEval's tests call its helpers (encode_cyclic for decode_cyclic),
    # and the completion's own versions of them must not be the ones the tests trust
    check = sandbox.Check(task.test, task.entry_point, context=task.prompt)
    return 1.0 if sandbox.run(code_solution(completion, task), limits, check=check).passed else 0.0


# ----------------------------------------------------------------------------- penalties

def overlong_penalty(length: int, *, max_len: int, buffer: int) -> float:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), in [-1, 0].

    0 up to max_len - buffer tokens, then falling linearly to -1 at max_len; -1 beyond.
    Raises ValueError unless 0 < buffer <= max_len.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len; got buffer={buffer}, max_len={max_len}")
    # eq. 13 with L_max = max_len and L_cache = buffer: a penalty that grows over the last `buffer` tokens, so
    # a response is steered away from the limit before truncation cuts it off, not only punished at it
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return (max_len - buffer - length) / buffer  # ((L_max - L_cache) - |y|) / L_cache
    return -1.0


def repetition_penalty(token_ids: Sequence[int], *, n: int = 4) -> float:
    """-(fraction of the completion's n-grams that repeat an earlier one), in [-1, 0]; 0 if it has none.

    Raises ValueError if n < 1.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    # over token ids, as generated (nothing to decode); a degenerate loop scores near -1, and a completion
    # shorter than n has no n-grams and no penalty
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    return -(len(grams) - len(set(grams))) / len(grams) if grams else 0.0


# ----------------------------------------------------------------------------- reward models

class RewardModel(Protocol):
    """A scalar reward model: one unbounded score per (prompt, completion); higher is better."""

    def score(self, prompts: list[str], completions: list[str]) -> list[float]: ...


class PairwiseJudge(Protocol):
    """A judge of completion against reference: P(completion is better), 1.0 / 0.5 / 0.0 for Better / Tie / Worse."""

    def compare(self, prompts: list[str], completions: list[str], references: list[str]) -> list[float]: ...


class StubRewardModel:
    """Deterministic stand-in for tests: a hash of (prompt, completion) mapped to [-1, 1], i.e. pure noise."""

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        out = []
        for p, c in zip(prompts, completions):
            # blake2b, not hash(): Python salts str hashes per process, and the stub must agree across runs and ranks
            h = int.from_bytes(hashlib.blake2b(f"{p}\0{c}".encode(), digest_size=8).digest(), "little")
            out.append(2.0 * h / 2**64 - 1.0)  # 64-bit integer -> [-1, 1)
        return out


class StubJudge:
    """Deterministic stand-in for tests: the shorter text is better, equal lengths tie."""

    def compare(self, prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
        return [JUDGE_OUTCOMES["better" if len(c) < len(r) else "tie" if len(c) == len(r) else "worse"]
                for c, r in zip(completions, references)]


def judge_score(p_better: torch.Tensor, *, dead_band: float) -> torch.Tensor:
    """Judge probabilities -> shaping scores in [-1, 1]: 0 where |p - 1/2| <= dead_band (a tie), linear to +-1 outside.

    Raises ValueError unless 0 <= dead_band < 1/2.
    """
    if not 0 <= dead_band < 0.5:
        raise ValueError(f"dead_band={dead_band} must lie in [0, 0.5)")
    # centred on a tie (p = 1/2); a dead band rather than the raw difference, so a judge that is unsure adds
    # nothing instead of noise; the final clamp covers a judge whose probabilities stray outside [0, 1]
    d = p_better.double() - 0.5
    return (d.sign() * (d.abs() - dead_band).clamp(min=0) / (0.5 - dead_band)).clamp(-1, 1)


def rm_score(scores_PG: torch.Tensor, *, scale: float, dead_band: float = 0.0) -> torch.Tensor:
    """Scalar reward-model scores -> shaping in [-1, 1]: tanh((x - group mean) / scale), dead band as judge_score.

    Raises ValueError unless scale > 0 and 0 <= dead_band < 1.
    """
    if scale <= 0 or not 0 <= dead_band < 1:
        raise ValueError(f"need scale > 0 and 0 <= dead_band < 1; got {scale}, {dead_band}")
    # centred per group: a reward model's offset says nothing about which of G responses is better; tanh
    # bounds an unbounded score to [-1, 1], the range adjust_rewards' guarantee assumes
    u = torch.tanh((scores_PG.double() - scores_PG.double().mean(-1, keepdim=True)) / scale)
    return u.sign() * (u.abs() - dead_band).clamp(min=0) / (1 - dead_band)


def adjust_rewards(correct_PG: torch.Tensor, shaping_PG: torch.Tensor, *, margin: float = 0.4) -> torch.Tensor:
    """Final rewards [P, G] (or [G]) fp32: c + margin * min(p, 1 - p) * clamp(s, -1, 1), p = mean_g c.

    correct_PG: 1 for correct, 0 for wrong. shaping_PG: reward-model, judge or penalty
    score. With margin < 1/2, in a group with both correct and wrong responses, no correct
    response gets a non-positive group-relative advantage and no wrong one a non-negative
    one (see the module docstring; a group with all or none correct is left as it is);
    all-zero shaping returns the correctness unchanged. Raises ValueError on a margin outside
    [0, 0.5), shapes that differ, or correctness other than 0/1.
    """
    if not 0 <= margin < 0.5:
        raise ValueError(f"margin={margin} must lie in [0, 0.5), or a correct answer could get a negative advantage")
    if correct_PG.shape != shaping_PG.shape:
        raise ValueError(f"correct {tuple(correct_PG.shape)} and shaping {tuple(shaping_PG.shape)} must match")
    c = correct_PG.double()
    if not ((c == 0) | (c == 1)).all():
        raise ValueError("correct must hold only 0 and 1")
    p = c.mean(-1, keepdim=True)  # [P, 1]: the group's fraction correct
    # r_i = c_i + m min(p, 1 - p) s_i, |s_i| <= 1 (the clamp), so |s_i - mean(s)| <= 2. For a correct response
    # r_i - mean(r) = (1 - p) + m min(p, 1 - p) (s_i - mean(s)) > (1 - p) - min(p, 1 - p) >= 0 when m < 1/2, and
    # for a wrong one r_i - mean(r) = -p + m min(p, 1 - p) (s_i - mean(s)) < -p + min(p, 1 - p) <= 0: the
    # advantage's sign is the correctness's, also after division by the group's std. And |shaping| < 1/4,
    # so every correct reward is > 3/4 and every wrong one < 1/4. At p in {0, 1} the factor is 0: the group
    # stays zero-variance, for the filter to decide on, instead of being made informative by shaping alone.
    return (c + margin * torch.minimum(p, 1 - p) * shaping_PG.double().clamp(-1, 1)).float()


@dataclass(frozen=True)
class RewardConfig:
    """How a group's rewards are shaped beyond correctness (TrainConfig's reward fields).

    reward_model: "" (none), "stub" (StubRewardModel, a scalar score) or "stub-judge"
    (StubJudge, pairwise against the gold answer); both stand-ins test the wiring, a real
    model plugs in behind the same protocol. max_new_tokens is the overlong penalty's limit.
    Raises ValueError on an unknown reward model, shaping_margin outside [0, 0.5),
    overlong_buffer outside [0, max_new_tokens], or judge_dead_band outside [0, 0.5).
    """
    max_new_tokens: int
    overlong_buffer: int = 0
    repetition_weight: float = 0.0
    reward_model: str = ""
    rm_weight: float = 0.5
    judge_dead_band: float = 0.1
    shaping_margin: float = 0.4

    def __post_init__(self):
        if self.reward_model not in REWARD_MODELS:
            raise ValueError(f"reward_model={self.reward_model!r}; valid: {', '.join(map(repr, REWARD_MODELS))}")
        if not 0 <= self.shaping_margin < 0.5:
            raise ValueError(f"shaping_margin={self.shaping_margin} must lie in [0, 0.5), or a correct answer could "
                             f"get a negative advantage")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} must lie in [0, max_new_tokens={self.max_new_tokens}]")
        if not 0 <= self.judge_dead_band < 0.5:
            raise ValueError(f"judge_dead_band={self.judge_dead_band} must lie in [0, 0.5)")

    @property
    def shapes(self) -> bool:
        """Whether any shaping applies (otherwise the reward is the correctness itself)."""
        return bool(self.overlong_buffer or self.repetition_weight or self.reward_model)


REWARD_MODELS = ("", "stub", "stub-judge")
RM_SCORE_SCALE = 1.0  # reward-model score units per tanh unit in the shaping score (the stub's scores lie in [-1, 1])


def reward_model_for(cfg: RewardConfig) -> RewardModel | PairwiseJudge | None:
    """The scorer cfg.reward_model names (None for "")."""
    return {"": None, "stub": StubRewardModel(), "stub-judge": StubJudge()}[cfg.reward_model]


def shaped_rewards(correct_G: torch.Tensor, completion_ids: list[list[int]], cfg: RewardConfig, *, scorer=None,
                   prompt: str = "", texts: list[str] | None = None, reference: str = "") -> torch.Tensor:
    """One group's final rewards [G] fp32: correctness plus shaping kept inside the correctness class.

    The shaping score s sums DAPO's overlong penalty, the repetition penalty and the
    scorer's term (a reward model's score through `rm_score`, or a judge's verdict against
    `reference` through `judge_score`), and enters through `adjust_rewards`, so no correct
    response's advantage turns negative. texts (the decoded completions) and prompt are
    needed only with a scorer. Without any shaping, the correctness is returned as it is.
    """
    if not cfg.shapes:  # the common case: no float64 detour, the verifier's rewards as they are
        return correct_G
    G = len(completion_ids)
    # the terms add up and may leave [-1, 1]; adjust_rewards clamps the sum, which is what its guarantee needs
    s_G = torch.zeros(G, dtype=torch.float64)
    if cfg.overlong_buffer:
        s_G += torch.tensor([overlong_penalty(len(x), max_len=cfg.max_new_tokens, buffer=cfg.overlong_buffer)
                             for x in completion_ids])
    if cfg.repetition_weight:
        s_G += cfg.repetition_weight * torch.tensor([repetition_penalty(x) for x in completion_ids])
    if hasattr(scorer, "compare"):  # a PairwiseJudge (the protocols are not runtime-checkable: duck typing)
        p_better = torch.tensor(scorer.compare([prompt] * G, texts, [reference] * G), dtype=torch.float64)
        # against the gold answer as the reference: better than gold pushes up, worse pushes down, a tie adds 0
        s_G += cfg.rm_weight * judge_score(p_better, dead_band=cfg.judge_dead_band)
    elif scorer is not None:
        scores = torch.tensor(scorer.score([prompt] * G, texts), dtype=torch.float64)
        s_G += cfg.rm_weight * rm_score(scores, scale=RM_SCORE_SCALE)
    return adjust_rewards(correct_G, s_G, margin=cfg.shaping_margin)


# ----------------------------------------------------------------------------- time limits

class ScoreTimeout(TimeoutError):
    """A verifier ran out of time: RewardPool and score_inline make it reward 0, reason "timeout"."""


class _Expired(BaseException):
    """Raised by the alarm inside a time-limited call. Not an Exception: math-verify and sympy catch Exception
    broadly (around sympy's doit, say), which would swallow the interruption and compute on."""


# past its limit the alarm fires again this often, should a bare `except:` swallow one; not more often, so that
# the cleanup on the way out (a finally block: the sandbox killing its run) is not cut off in turn
ALARM_REPEAT_S = 1.0
KILL_GRACE_S = 1.0  # a worker process this far past its own time limit is stuck where no signal reaches: killed
_alarm_armed = False  # main thread: a time_limited call is running under SIGALRM
_thread_limit = threading.local()  # off the main thread: .deadline (time.monotonic()) of the enclosing limit


def _on_alarm(_signum, frame):
    if not _alarm_armed:  # an alarm already on its way when the call ended must not hit the caller
        return
    while frame is not None:
        # An import cut off halfway would leave its package half-initialised (sympy's classes made anew on the
        # next import, unlike the ones already in use): let it finish, the alarm repeats every ALARM_REPEAT_S
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return
        frame = frame.f_back
    raise _Expired


def time_limited(fn: Callable, *args, seconds: float):
    """fn(*args), which must finish within `seconds` or raise ScoreTimeout.

    On the main thread a SIGALRM timer interrupts the call between bytecodes and inside
    CPython's big-integer power, which checks for signals (where math-verify spends a
    huge exponent's time); it repeats every ALARM_REPEAT_S past the limit. Inside an
    active limit the enclosing one governs. Off the main thread no signal can interrupt
    fn: the limit becomes the thread's deadline, which math_equal keeps (its grader
    process is killed at it); other verifiers run on, and RewardPool's watchdog abandons
    them at the limit.
    """
    global _alarm_armed
    if seconds <= 0:  # a zero timer would mean no timer at all
        raise ScoreTimeout(f"no time left ({seconds} s)")
    if threading.current_thread() is not threading.main_thread():
        outer = getattr(_thread_limit, "deadline", None)
        mine = time.monotonic() + seconds
        _thread_limit.deadline = mine if outer is None else min(outer, mine)
        try:
            return fn(*args)
        finally:
            _thread_limit.deadline = outer
    if _alarm_armed:
        return fn(*args)
    previous = signal.signal(signal.SIGALRM, _on_alarm)  # the process's one real-time timer is this call's now
    _alarm_armed = True
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)  # inside: however soon it fires
            return fn(*args)
        finally:
            while True:  # an alarm that lands in here before the flag is down is caught, and this retried
                try:
                    _alarm_armed = False  # from here on the handler raises nothing
                    break
                except _Expired:
                    pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
    except _Expired:  # converted out here, once no alarm can interrupt the conversion
        raise ScoreTimeout(f"over {seconds} s") from None


def _seconds_left(default: float) -> float:
    """Off the main thread: the time to the enclosing limit's deadline, else `default`."""
    deadline = getattr(_thread_limit, "deadline", None)
    return default if deadline is None else deadline - time.monotonic()


def score_inline(fn: Callable[..., float], *args, timeout_s: float) -> tuple[float, str]:
    """fn(*args) on the calling thread, time-limited, as a RewardPool would score it: (reward, reason).

    For scoring without a pool (train.py's inline path): a verifier that raises, returns a
    non-finite value or runs past timeout_s gets reward 0 and the reason RewardPool gives
    ("error: <type>", "timeout"), never a hang (on the main thread; see time_limited).
    """
    return _call(functools.partial(time_limited, fn, seconds=timeout_s), args)


class _Worker:
    """A spawned process that answers fn(*args) requests on its main thread (_process_worker)."""

    def __init__(self, fn: Callable, limit_s: float | None):
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe in a process running torch threads
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_process_worker, args=(child_conn, fn, limit_s), daemon=True)
        self.proc.start()
        child_conn.close()
        try:
            self.conn.recv()  # "ready": start-up (imports) ends before an item's clock starts
        except BaseException:
            self.kill()
            raise

    def call(self, args: tuple, wait_s: float) -> tuple[float, str] | None:
        """fn's (reward, reason), or None if none came within wait_s (the process is then killed).

        Raises EOFError or OSError if the process died.
        """
        self.conn.send(args)
        if self.conn.poll(wait_s):  # blocks without the GIL; the worker's CPU time is its own process's
            return self.conn.recv()
        self.kill()
        return None

    def kill(self):
        self.proc.kill()  # a hung worker may be deep in C code: kill, not ask
        self.proc.join()


def _process_worker(conn, fn, limit_s):
    if limit_s is not None:  # on the process's main thread: a signal can stop fn at the limit, no kill needed
        fn = functools.partial(time_limited, fn, seconds=limit_s)
    conn.send("ready")  # sent once spawn has imported fn's module: the caller starts the item's clock after it
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the caller's end of the pipe is gone: no more items will come
            return
        conn.send(_call(fn, args))


_idle_graders: list[_Worker] = []  # math grader processes free for the next thread's math_equal
_graders_lock = threading.Lock()


def _grade(answer: str, gold: str, seconds: float) -> bool:
    """A grader process's work: math_equal on its own main thread, limited by a signal."""
    return time_limited(_math_equal_here, answer, gold, seconds=seconds)


def _grade_elsewhere(answer: str, gold: str) -> bool:
    """math_equal in a grader process (one per concurrent caller, kept for reuse), to the thread's limit."""
    with _graders_lock:
        grader = _idle_graders.pop() if _idle_graders else None
    if grader is None:  # a few seconds: the grader imports this file, and math-verify on its first item
        grader = _Worker(_grade, None)
    seconds = _seconds_left(MATH_TIMEOUT_S)  # after the start-up, which may have used up the caller's limit
    result = (0.0, "timeout")
    if seconds > 0:
        try:
            # the grader stops itself at `seconds`; it is killed only if stuck where no signal reaches
            result = grader.call((answer, gold, seconds), seconds + KILL_GRACE_S)
        except (EOFError, OSError) as e:  # the grader died (out of memory, say)
            grader.kill()
            raise RuntimeError("math grader process died") from e
    if result is None:
        raise ScoreTimeout(f"math-verify over {seconds:.1f} s (grader killed)")
    with _graders_lock:
        _idle_graders.append(grader)
    value, reason = result
    if reason == "timeout":
        raise ScoreTimeout(f"math-verify over {seconds:.1f} s")
    if reason != "ok":
        raise RuntimeError(f"math grader: {reason}")
    return value == 1.0


# ----------------------------------------------------------------------------- overlapped scoring

def _call(fn: Callable[..., float], args: tuple) -> tuple[float, str]:
    try:
        value = float(fn(*args))
    except ScoreTimeout:
        return 0.0, "timeout"
    except Exception as e:  # a verifier's failure is reward 0, never a crash
        return 0.0, f"error: {type(e).__name__}"
    # a NaN or inf would reach its group's mean and std and make every advantage of that group NaN
    return (value, "ok") if math.isfinite(value) else (0.0, "error: non-finite reward")


GIL_SWITCH_INTERVAL_S = 0.05  # while a thread-mode RewardPool is open (see its docstring)


class RewardPool:
    """Scores submitted items on `workers` workers while the caller goes on (e.g. generating).

    fn(*args) -> float is the verifier. Threads (default) suit verifiers that wait (a
    sandbox subprocess, a remote model, math_equal's grader process) or are quick;
    processes=True runs fn in spawned worker processes (fn and args must pickle), where
    CPU-bound Python does not hold the caller's GIL. Each item's timeout counts from when
    a worker starts it. Thread mode calls fn on the worker thread itself, under
    time_limited (math_equal's grader keeps the limit), and a watchdog gives an item that
    overruns reward 0 ("timeout") and starts a fresh worker in place of the stuck one,
    which is abandoned (a thread cannot be killed; it ends on its own or with the process).
    A worker process stops fn itself at the timeout (a signal on its main thread) and is
    killed and replaced if still silent KILL_GRACE_S later. No thread is started
    per item: thread churn slows the generation it overlaps. While a thread-mode pool is
    open the interpreter's GIL switch interval is at least GIL_SWITCH_INTERVAL_S: at the
    default 5 ms, workers waking to record a score make the generating thread hand the
    GIL over mid-step (bench/reward_overlap.py measures the overlap); they get it anyway
    whenever a torch op releases it.
    `counts` tallies the reasons: "ok", "timeout", "error: <exception type>".

    Threads and locks: `_todo` (a queue.Queue, locked by itself) carries items and stop
    sentinels to the runners. `_cond` guards `_done`, `counts`, `_running` and `_runners`;
    the runners, the watchdog, `gather` and `close` take it. In thread mode an item's result
    is recorded by whoever removes its runner's entry from `_running`: the runner when fn
    returns, or the watchdog when the item overran; so every key gets exactly one reward.
    In process mode each runner thread owns one worker process and its pipe, unshared, and
    keeps the timeout itself (a process can be killed), so there is no watchdog.
    """

    def __init__(self, fn: Callable[..., float], *, workers: int, timeout_s: float, processes: bool = False):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0; got {workers}, {timeout_s}")
        self.fn, self.timeout_s, self.processes = fn, timeout_s, processes
        self.counts: Counter = Counter()
        self._todo: queue.Queue = queue.Queue()  # (key, args) items, then one None per runner at close
        self._done: dict = {}  # key -> (reward, reason), until gathered
        self._cond = threading.Condition()  # the one lock of the shared state; gather waits on it for results
        self._running: dict = {}  # thread-mode runner -> (key, start time) of the item it is scoring
        self._closed = threading.Event()  # stops the watchdog, once every runner has ended
        self._runners = [self._start_runner() for _ in range(workers)]  # the live runners; the watchdog swaps them
        self._watchdog, self._switch_interval = None, None
        if not processes:
            self._watchdog = threading.Thread(target=self._watch, daemon=True)
            self._watchdog.start()
            # process-wide: restored by close(). A thread that waits for the GIL asks its holder to drop it after
            # the interval; a longer one lets the generating thread finish more of a step before a worker that
            # only records a score takes the GIL (it also gets it whenever a torch op releases it)
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(max(self._switch_interval, GIL_SWITCH_INTERVAL_S))

    def _start_runner(self) -> threading.Thread:
        # daemon: an abandoned runner stuck in fn must not keep the interpreter from exiting
        t = threading.Thread(target=self._runner, daemon=True)
        t.start()
        return t

    def submit(self, key, *args):
        """Queue fn(*args) under `key` (hashable, unique among keys not yet gathered); returns at once."""
        self._todo.put((key, args))

    def gather(self, keys: list) -> tuple[list[float], list[str]]:
        """Rewards and reasons for `keys`, in order, once all are scored; forgets them afterwards."""
        with self._cond:
            # woken by every _finish; no timeout needed: every submitted key gets a result, a timed-out one too
            self._cond.wait_for(lambda: all(k in self._done for k in keys))
            out = [self._done.pop(k) for k in keys]
        return [r for r, _ in out], [why for _, why in out]

    def close(self):
        """Score what is queued, then stop the workers (a stuck one is timed out, not waited for)."""
        with self._cond:  # the watchdog may be swapping runners
            n = len(self._runners)
        for _ in range(n):  # queued behind the items, so every queued item is still scored
            self._todo.put(None)  # a runner replaced by the watchdog passes its stop on to its successor
        # join in short slices, re-reading the list: while a runner is stuck the watchdog must stay up to time
        # it out, and the runner it starts in its place has to be waited for too
        while True:
            with self._cond:
                live = [t for t in self._runners if t.is_alive()]
            if not live:
                break
            live[0].join(0.05)
        self._closed.set()  # only now: a stuck item during close is still timed out by the watchdog
        if self._watchdog is not None:
            self._watchdog.join()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _finish(self, key, result):
        with self._cond:
            self._done[key] = result
            self.counts[result[1]] += 1
            self._cond.notify_all()  # gather() may wait for a different set of keys: wake every waiter

    def _runner(self):
        me, worker = threading.current_thread(), None  # worker: (process, connection) in process mode
        while (job := self._todo.get()) is not None:
            key, args = job
            if self.processes:
                try:
                    result, worker = self._in_process(args, worker)
                except Exception as e:  # e.g. args that do not pickle: still a reward, never a lost item
                    result = (0.0, f"error: {type(e).__name__}")
                self._finish(key, result)
                continue
            with self._cond:  # registered with the watchdog; the item's timeout counts from here
                self._running[me] = (key, time.monotonic())
            # on this thread: no thread per item, whose churn slows generation; time_limited hands the limit to
            # verifiers that keep it themselves (math_equal's grader), so they end when the watchdog gives up
            result = _call(functools.partial(time_limited, self.fn, seconds=self.timeout_s), args)
            with self._cond:
                abandoned = self._running.pop(me, None) is None  # the watchdog timed this item out
            if abandoned:
                return  # a fresh runner took this one's place
            self._finish(key, result)
        if worker is not None:  # the stop sentinel: end this runner's worker process with it
            worker.kill()

    def _watch(self):
        """Thread mode: time out items that overrun, replacing their runners."""
        # checked often enough that an item overruns its timeout by at most a tenth of it (or 50 ms)
        while not self._closed.wait(min(0.05, self.timeout_s / 10)):
            now = time.monotonic()
            with self._cond:
                late = [(t, key) for t, (key, start) in self._running.items() if now - start > self.timeout_s]
                for t, key in late:
                    # A thread cannot be killed: the stuck runner is abandoned (its entry gone, it discards its
                    # result and ends once fn returns) and a fresh one keeps `workers` items in flight. The
                    # abandoned one never takes a stop sentinel; its successor takes the one meant for it.
                    del self._running[t]
                    self._runners.remove(t)
                    self._runners.append(self._start_runner())
            for _, key in late:  # the late items' one result each: their runners will discard theirs
                self._finish(key, (0.0, "timeout"))

    def _in_process(self, args: tuple, worker: _Worker | None) -> tuple[tuple[float, str], _Worker | None]:
        """Score in this runner's worker process (started on first use, replaced after a kill or death)."""
        try:
            if worker is None:
                worker = _Worker(self.fn, self.timeout_s)
            # the worker stops fn itself at timeout_s (a signal on its main thread); a worker still silent
            # KILL_GRACE_S later is stuck where no signal reaches and is killed
            result = worker.call(args, self.timeout_s + KILL_GRACE_S)
            if result is not None:
                return result, worker
            return (0.0, "timeout"), None
        except (EOFError, OSError):  # the worker exited or crashed (e.g. out of memory) mid-item
            if worker is not None:
                worker.kill()
            return (0.0, "error: worker died"), None
