"""Multi-turn rollouts that call tools: `ToolEngine`, an `Engine` whose rows may call the run's tools between
assistant turns, over any engine (the native one, static or continuous, sharded or not, and SGLang's).

Owns part 3 of agentic RL (issue 34, "Rollouts") in its synchronous form: rounds. The first round generates
every prompt's n samples; a turn that ends with the template's tool stop (`Tokenizer.tool_stop_id`) and holds
call blocks has its calls answered (`tool_calls.run_calls`: errors are text for the model, never exceptions),
and the tool turn (`Tokenizer.tool_turn_ids`, the template's rendered delta) is appended to the row's one
token stream, never re-rendered from text; the next round generates the next assistant turn from the
prompt plus that stream. One append-only stream per row is verl's agent loop and slime's layout; the tool
turns' tokens are fed to the model (KV, routes) and carry loss mask 0 and logprob 0 (sampler.Rollout.loss_mask).
build_engine (rollout.py) wraps the run's engine in one when `tools.enabled` names a tool.

Notable choices:
1. Routes as first recorded (slime's rule; verl overwrites them, which mixes two forwards in one row): a
   round re-prefills the whole stream, and only the positions new since the row's last round (its last
   sampled token, the tool turn, the new turn) take that call's routes. Every round of a generate call runs
   on one weight version (a row whose rounds report two raises RuntimeError), so the routes of old
   positions would differ only by float rounding.
2. Random streams: round k >= 1 of row (group g, sample j) samples from keys (turn_seed(seed, k), g * n + j, 0):
   distinct per row and round and independent of which rows share a call or a rank, so the rounds are as
   batch-invariant as one call is. The first round is the call a run without tools makes.
3. Budget: a row's whole stream (its turns and tool turns) stays within params.max_new_tokens. A round's
   call asks for the most any of its rows has left, and each row keeps only its own budget's tokens (the
   same tokens a call of its own would sample, sampling being causal and batch-invariant); a tool turn that
   leaves no room for a token ends the row, finish_reason "length", its calls unanswered. After
   tools.max_turns assistant turns a row ends, whatever it calls.
4. A round's rows go in as few calls as the context allows (each call's longest stream plus its largest
   budget within max_seq_len). Under torchrun the calls are planned from every rank's rows (one all_gather
   per round), so every rank makes the same calls with the same budget, with no rows where it has none: the
   sharded native engine's generate is a collective, its decode steps counted alike on every rank.
5. This is the synchronous baseline (generate all, run all tools, re-prefill): every row waits for the
   round's slowest tool. The native engine's in-flight form, where a row waiting on a tool keeps its KV
   pages and gives up its slot while other rows decode, is not built yet (issue 34 part 3).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from distributed import all_gather_list, rank_world
from sampler import Rollout, SamplingParams, mix64
from tool_calls import Calculator, Tool, ToolConfig, build_tools, call_format, run_calls, write_call

if TYPE_CHECKING:
    from data import Item
    from tokenizer import Tokenizer

TOOL_COUNTERS = ("tool_calls", "tool_failures", "tool_timeouts", "tool_truncations", "tool_turns", "tool_ms")
"""What ToolEngine.counters() adds, each every phase (0 when nothing was called): logged as engine/<name>."""
SEED_BITS = (1 << 62) - 1  # a turn's seed is kept non-negative, as an unseeded call's and SGLang's sampling_seed are
EXPRESSION_RE = re.compile(r"[-\d(][\d\s+\-*/%().]*[\d)]")  # a run of arithmetic: numbers, operators, parentheses
GOLDEN = 0.6180339887498949  # item i calls in its demonstration when frac(i * GOLDEN) < the share: evenly spread


def turn_seed(seed: int, turn: int) -> int:
    """The seed of round `turn` (>= 1) of a generate call seeded `seed`: a hash of the pair (choice 2)."""
    return int(mix64(mix64(torch.tensor(seed, dtype=torch.int64)) ^ turn)) & SEED_BITS


@dataclass
class _Row:
    """One row's stream so far: its completion ids (turns and tool turns), their logprobs and loss mask, the
    routes of every token fed, and what its tools cost."""
    first: Rollout  # the first round's: prompt, group, sample
    key: int  # g * n + j: its random stream in later rounds (choice 2)
    ids: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    fed: int = 0  # positions whose routes are recorded: prompt + ids - 1 after each round
    last: Rollout | None = None  # its latest turn, as kept
    turns: int = 0
    calls: int = 0
    failures: int = 0
    finish: str = "length"
    done: bool = False  # ended: its answer given, its turns or budget spent

    def take(self, turn: Rollout, budget: int):
        """Append a turn's tokens (at most `budget`), their logprobs and the routes of the positions new to it."""
        c = len(turn.completion_ids)
        keep = min(c, budget)
        stop = turn.finish_reason == "stop" and c <= budget
        kept = Rollout(turn.prompt_ids, turn.completion_ids[:keep], turn.logprobs[:keep], turn.routes,
                       "stop" if stop else "length", turn.group_id, turn.weight_version)
        if self.last is not None and kept.weight_version != self.last.weight_version:
            raise RuntimeError(f"a multi-turn row of group {turn.group_id} spans weight versions "
                               f"{self.last.weight_version} and {kept.weight_version}: a generate call's rounds must "
                               f"run on one version")
        total = len(turn.prompt_ids) + keep - 1  # the positions fed so far: prompt, stream, all but the last token
        self.routes.append(turn.routes[self.fed:total])
        self.ids += kept.completion_ids
        self.logprobs.append(kept.logprobs)
        self.mask += [1] * keep
        self.fed, self.last, self.finish = total, kept, kept.finish_reason
        self.turns += 1

    def feed(self, tool_ids: list[int]):
        """Append a tool turn: fed to the model, never trained (mask 0, logprob 0)."""
        self.ids += tool_ids
        self.logprobs.append(torch.zeros(len(tool_ids)))
        self.mask += [0] * len(tool_ids)

    def rollout(self, text: str) -> Rollout:
        r = self.first
        return Rollout(r.prompt_ids, self.ids, torch.cat(self.logprobs), torch.cat(self.routes), self.finish,
                       r.group_id, r.weight_version, loss_mask=self.mask if 0 in self.mask else None, text=text,
                       turns=self.turns, tool_calls=self.calls, tool_failures=self.failures)


class ToolEngine:
    """An Engine (rollout.Engine) whose rows call tools between turns, in rounds over `inner` (choices 1-5).

    inner: the engine it wraps, a rollout.Engine (not imported: rollout.build_engine imports this file);
    tok: the run's tokenizer, with a chat template that renders tool turns (`Tokenizer.tool_turn_ids`; a
    ValueError here names a template that cannot); cfg: the run's tools section; model_type: the checkpoint
    family's (model.hf_model_type), whose call format the turns are read in (tool_calls.call_format);
    max_seq_len: the model's context, which each round's calls keep within; tools: in place of cfg's enabled
    ones (an eval's control: evaluation.RandomAnswers).
    counters() adds this phase's tool counts to the inner engine's: tool_calls, tool_failures, tool_timeouts,
    tool_truncations, tool_turns (assistant turns after a row's first), tool_ms (milliseconds in tools)."""

    def __init__(self, inner, tok: Tokenizer, cfg: ToolConfig, *, model_type: str, max_seq_len: int,
                 tools: dict[str, Tool] | None = None):
        self.inner, self.tok, self.cfg, self.max_seq_len = inner, tok, cfg, max_seq_len
        self.model_type, self.call_format = model_type, call_format(model_type)  # none known: ValueError naming it
        self.tools = tools if tools is not None else build_tools(cfg)
        self.stop_id = tok.tool_stop_id  # checks the template renders tool turns, before any work
        self.pool = ThreadPoolExecutor(cfg.call_workers, thread_name_prefix="tool")
        self.counts, self._depth = Counter(dict.fromkeys(TOOL_COUNTERS, 0)), 0

    def replaced(self, tools: dict[str, Tool]) -> ToolEngine:
        """This engine with `tools` answering the calls in place of its own (an eval's control)."""
        return ToolEngine(self.inner, self.tok, self.cfg, model_type=self.model_type, max_seq_len=self.max_seq_len,
                          tools=tools)

    # ------------------------------------------------------------------ the Engine protocol, passed through

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def update_weights(self, named_tensors, version: int) -> None:
        self.inner.update_weights(named_tensors, version)

    @contextmanager
    def phase(self):
        if not self._depth:  # this phase's counts, as the inner engine's
            self.counts = Counter(dict.fromkeys(TOOL_COUNTERS, 0))
        self._depth += 1
        try:
            with self.inner.phase():
                yield
        finally:
            self._depth -= 1

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def memory(self) -> dict[str, int]:
        return self.inner.memory()

    def counters(self) -> dict[str, int]:
        return {**self.inner.counters(), **{k: int(self.counts[k]) for k in TOOL_COUNTERS}}

    # ------------------------------------------------------------------ rounds

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]:
        """As NativeEngine.generate, each row's turns and tool turns in one Rollout (prompt-major)."""
        if seed is None:
            seed = int(torch.randint(1 << 62, (1,)))
        groups = group_ids if group_ids is not None else list(range(len(prompts)))
        first = self.inner.generate(prompts, params, n=n, seed=seed, group_ids=groups)
        rows = [_Row(r, key=r.group_id * n + i % n) for i, r in enumerate(first)]
        for row, r in zip(rows, first):
            row.take(r, params.max_new_tokens)
        for turn in range(1, self.cfg.max_turns):
            going = [row for row in rows if not row.done and self._answer(row, params.max_new_tokens)]
            calls = self._calls(going, params.max_new_tokens)
            if not calls:
                break
            for call, budget in calls:
                outs = self.inner.generate([row.first.prompt_ids + row.ids for row in call],
                                           SamplingParams(budget, params.temperature, params.top_p, params.top_k),
                                           n=1, seed=turn_seed(seed, turn), group_ids=[row.key for row in call])
                for row, out in zip(call, outs):
                    row.take(out, params.max_new_tokens - len(row.ids))
                    self.counts["tool_turns"] += 1
        return [row.rollout(self.tok.decode(row.ids[:-1] if row.finish == "stop" else row.ids)) for row in rows]

    def _answer(self, row: _Row, max_new_tokens: int) -> bool:
        """Answer the calls of the row's latest turn and append the tool turn; False when the row ends (then done)."""
        row.done = True  # unless a tool turn is appended below
        turn = row.last
        if turn.finish_reason != "stop" or turn.completion_ids[-1] != self.stop_id:
            return False
        t0 = time.perf_counter()
        results, counts = run_calls(self.tok.decode(turn.completion_ids[:-1]), self.tools, self.cfg,
                                    call_format=self.call_format, codec=self.tok, pool=self.pool,
                                    calls_before=row.calls)
        self.counts["tool_ms"] += 1000 * (time.perf_counter() - t0)
        if not counts.calls:  # a turn without calls is the row's answer
            return False
        row.calls += counts.calls
        row.failures += sum(counts.failures.values())
        self.counts.update(tool_calls=counts.calls, tool_failures=sum(counts.failures.values()),
                           tool_timeouts=counts.timeouts, tool_truncations=counts.truncations)
        tool_ids = self.tok.tool_turn_ids([r.text for r in results])
        if len(row.ids) + len(tool_ids) >= max_new_tokens:  # no room left for a token after it (choice 3)
            row.finish = "length"
            return False
        row.feed(tool_ids)
        row.done = False
        return True

    def _calls(self, rows: list[_Row], max_new_tokens: int) -> list[tuple[list[_Row], int]]:
        """The round's calls, each this rank's rows in it and its budget (max_new_tokens): every rank's rows in calls
        whose longest stream plus largest budget fits the context, planned alike on every rank from all of their
        (stream, budget) pairs, so every rank makes the same calls with the same budgets (choice 4)."""
        rank, world = rank_world()
        mine = [(len(r.first.prompt_ids) + len(r.ids), max_new_tokens - len(r.ids), rank, i)
                for i, r in enumerate(rows)]
        everyone = all_gather_list(mine) if world > 1 else mine  # one collective a round
        plan, longest, most = [], 0, 0
        for length, budget, r, i in sorted(everyone):
            if plan and max(longest, length) + max(most, budget) <= self.max_seq_len:
                plan[-1].append((budget, r, i))
                longest, most = max(longest, length), max(most, budget)
            else:
                plan.append([(budget, r, i)])
                longest, most = length, budget
        return [([rows[i] for _, r, i in call if r == rank], max(b for b, _, _ in call)) for call in plan]


# ----------------------------------------------------------------------------- SFT demonstrations that call

def arithmetic_expression(question: str) -> str | None:
    """The question's longest run of arithmetic with an operator in it ("Calculate 12 + 3 * 4." -> "12 + 3 * 4")."""
    runs = [m.group().strip() for m in EXPRESSION_RE.finditer(question)]
    runs = [r for r in runs if any(op in r for op in "+-*/%")]
    return max(runs, key=len) if runs else None


def demonstration_ids(tok: Tokenizer, cfg: ToolConfig, model_type: str, item: Item,
                      demonstration: str) -> tuple[list[int], list[int] | None]:
    """An SFT target's completion ids, its stop token included, and its loss mask (None: every token imitated).

    With the calculator enabled, for a share of items (cfg.sft_call_share, spread by GOLDEN) whose question holds
    an arithmetic expression: a call of the calculator with it, the template's tool stop, the tool turn with the
    calculator's answer (mask 0: fed, never imitated), then `demonstration` (the task's answer), as a multi-turn
    rollout would write them, the call in model_type's call format. Otherwise `demonstration` alone."""
    plain = tok.encode(demonstration) + [tok.stop_ids[0]]  # a chat model's end of turn comes first
    expression = arithmetic_expression(item.question)
    if "calculator" not in cfg.enabled or expression is None or (item.index * GOLDEN) % 1 >= cfg.sft_call_share:
        return plain, None
    answer = Calculator().call({"expression": expression}).text
    call = tok.encode(write_call(call_format(model_type), "calculator", {"expression": expression}))
    call.append(tok.tool_stop_id)
    tool = tok.tool_turn_ids([answer])
    return call + tool + plain, [1] * len(call) + [0] * len(tool) + [1] * len(plain)
