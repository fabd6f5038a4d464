"""The held-out evals of a run: `evaluate` (per held-out prompt, the mean reward of its samples, scored as the
RL step scores, under reward.timeout_s), `run_eval` (sampled and greedy accuracy, logged) and `summarize` (the
run's last lines: optimizer steps, the plot, the accuracy before and after RL). A completion's text, as a verifier
reads it, is `Rollout.text`, the engine's decode by the run's tokenizer (the RL step's too)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from data import Item, Task, prompt_ids
from distributed import all_gather_list, rank_world
from metrics import MetricsLog, plot
from rollout import Engine
from sampler import texts
from tool_calls import Tool, ToolResult, tool_schemas
from tool_rollout import ToolEngine
from scoring import RewardPool, score_inline

if TYPE_CHECKING:
    from config import TrainConfig
    from tokenizer import Tokenizer



@dataclass
class HeldOut:
    """The held-out prompts a run evaluates on, their task (the verifier), and the accuracies measured on them: per
    prompt, by pass (run_eval's: "sampled", "greedy", and with tools the others), before RL (after the SFT
    warm-up; None with eval_before_rl off) and at the latest eval after it."""
    task: Task
    items: list[Item]
    before_rl: dict[str, torch.Tensor] | None = None
    after_rl: dict[str, torch.Tensor] | None = None


@torch.no_grad()
def evaluate(engine: Engine, tok: Tokenizer, held: HeldOut, cfg: TrainConfig, *, samples: int,
             temperature: float, tools: list[dict] | None = None) -> tuple[torch.Tensor, Counter, torch.Tensor]:
    """Per held-out item, the mean binary reward of `samples` completions at `temperature`, [n] fp32, how their
    scoring went over every rank (a count per reason: "ok", "timeout", "error: <type>") and per item the share
    of its completions that called a tool, [n] fp32. tools: the schemas the prompts show (None: no tools).

    Scored as the RL step scores (score_rollouts): each completion within reward.timeout_s, by reward
    workers beside generation when the run has them (reward.workers: a RewardPool of the held-out task's
    verifier, the run's own pool being bound to the training task's), else on this thread (scoring.score_inline).
    A completion that cannot be scored (math-verify on 9^{9^{9^{9}}}, a verifier that raises) counts as
    wrong and is counted; it never ends the run. temperature 0 is greedy (use samples=1). Sampling is
    seeded by cfg.seed, so every eval of a run draws from the same random stream.
    """
    items, task = held.items, held.task
    params = dataclasses.replace(cfg.sampling, temperature=temperature)
    rank, world = rank_world()
    # items per call and rank: eval_batch_rows' worth, or with engine.slots all of this rank's (one call, `slots` live)
    rows = max(1, -(-len(items) // world)) if cfg.engine.slots else max(1, cfg.eval_batch_rows // samples)
    mine = list(range(rank, len(items), world))  # multi-rank: rank r takes items r, r + world, ...
    calls = -(-len(items) // (rows * world))  # as many on every rank (the sharded engine's calls are collectives)
    pool = None
    if cfg.reward.workers:  # the run scores on workers: so does its eval, with the same number and limit
        pool = RewardPool(task.score, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
    group_ids, results, called = [], [], []  # per completion: its item, its (reward, reason), whether it called
    try:
        with engine.phase():
            for c in range(calls):
                chunk = mine[c * rows:(c + 1) * rows]
                # item i's stream is keyed by (cfg.seed, i, sample): the same whichever rank and call generate it
                outs = engine.generate([prompt_ids(tok, task, items[i], cfg.system_prompt, tools) for i in chunk],
                                       params, n=samples, seed=cfg.seed, group_ids=chunk)
                for r, text in zip(outs, texts(outs)):  # a completion's key: its position among this rank's
                    item = items[r.group_id]
                    if pool is not None:
                        pool.submit(len(group_ids), text, item)
                    else:
                        results.append(score_inline(task.score, text, item, timeout_s=cfg.reward.timeout_s))
                    group_ids.append(r.group_id)
                    called.append(r.tool_calls > 0)
        if pool is not None:
            rewards, reasons = pool.gather(list(range(len(group_ids))))
            results = list(zip(rewards, reasons))
    finally:
        if pool is not None:
            pool.close()
    # sorted by item, stable: each item's samples stay in order
    scored = sorted(all_gather_list([(g, w, why, c) for g, (w, why), c in zip(group_ids, results, called)]),
                    key=lambda s: s[0])
    reward = torch.tensor([w for _, w, _, _ in scored], dtype=torch.float32).view(len(items), samples)
    calls = torch.tensor([c for *_, c in scored], dtype=torch.float32).view(len(items), samples)
    return reward.mean(dim=1), Counter(why for _, _, why, _ in scored), calls.mean(dim=1)  # (items, samples) -> [n]


def run_eval(engine: Engine, tok: Tokenizer, held: HeldOut, cfg: TrainConfig, log: MetricsLog, step: int,
             t_start: float) -> dict[str, torch.Tensor] | None:
    """Sampled (mean of eval_samples at the rollout temperature) and greedy accuracy per held-out prompt, logged
    (`log`, the run's time since t_start) with `eval/unscored`: the completions that could not be scored
    (timeout or error), counted wrong. With tools (a ToolEngine) three greedy passes more show what the tool
    is worth: "tools off" (the prompts without the tools, no calls answered), "random tools" (each tool answers
    RandomAnswers' numbers: the model reads what its tool says only if this falls) and the "call rate" with tools.
    Returns {name: per-prompt [n]} in that order; None, with nothing generated or logged, for held-out prompts
    without gold answers (data.PromptTask): their verifier pays 0 whatever the answer, an accuracy that
    measures nothing."""
    if not held.task.has_gold:
        return None
    schemas = tool_schemas(cfg.tools)
    sampled, reasons, _ = evaluate(engine, tok, held, cfg, samples=cfg.eval_samples,
                                   temperature=cfg.sampling.temperature, tools=schemas)
    greedy, greedy_reasons, calls = evaluate(engine, tok, held, cfg, samples=1, temperature=0.0, tools=schemas)
    reasons.update(greedy_reasons)
    out = {"sampled": sampled, "greedy": greedy}
    if isinstance(engine, ToolEngine):
        tooled: ToolEngine = engine
        out["tools off"] = evaluate(tooled.inner, tok, held, cfg, samples=1, temperature=0.0)[0]
        random_tools = tooled.replaced({name: RandomAnswers(tool) for name, tool in tooled.tools.items()})
        out["random tools"] = evaluate(random_tools, tok, held, cfg, samples=1, temperature=0.0, tools=schemas)[0]
        out["call rate"] = calls
    unscored = sum(n for why, n in reasons.items() if why != "ok")
    (acc, se), (g_acc, g_se) = mean_se(sampled), mean_se(greedy)
    extra = {f"eval_{name.replace(' ', '_')}": mean_se(x)[0] for name, x in out.items()
             if name not in ("sampled", "greedy")}
    log({"stage": "eval", "step": step, "eval_acc": acc, "eval_se": se, "eval_greedy_acc": g_acc,
         "eval_greedy_se": g_se, **extra, "eval/unscored": unscored, "time": time.perf_counter() - t_start})
    if rank_world()[0] == 0:
        tqdm.write(f"step {step}: eval accuracy {acc:.3f} +- {se:.3f} sampled, {g_acc:.3f} +- {g_se:.3f} greedy"
                   + "".join(f", {k.removeprefix('eval_').replace('_', ' ')} {v:.3f}" for k, v in extra.items()))
        if unscored:
            causes = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()) if why != "ok")
            tqdm.write(f"step {step}: eval: {unscored} completions could not be scored ({causes}), counted wrong")
    return out


class RandomAnswers:
    """A tool's control for the eval: `tool`'s name and schema, and for each call its answer's digits replaced
    by random ones (seeded by the arguments), signs, separators and errors kept: a model that reads its tool's
    answers loses what the tool gave it."""

    def __init__(self, tool: Tool):
        self.tool, self.name, self.schema = tool, tool.name, tool.schema

    def call(self, args: dict) -> ToolResult:
        result = self.tool.call(args)
        if not result.ok:
            return result
        rng = random.Random(repr(sorted(args.items())))
        return ToolResult("".join(str(rng.randrange(10)) if ch.isdigit() else ch for ch in result.text))


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error std/sqrt(n) (population std: sqrt(p(1-p)/n) for 0/1 data)."""
    return x.mean().item(), (x.var(correction=0) / len(x)).sqrt().item()


def summarize(cfg: TrainConfig, held: HeldOut, records: list[dict], t_start: float) -> dict:
    """The end of a run: the optimizer steps taken (its RL records'), the plot and the held-out accuracy table,
    printed by rank 0; returns their numbers."""
    rank = rank_world()[0]
    rl = [r for r in records if r.get("stage") == "rl"]
    summary = {"optimizer_steps": sum(r.get("optimizer_steps", 0) for r in rl)}
    if rank == 0:
        plot(records, os.path.join(cfg.out_dir, "plot.png"))
        skipped = sum(r.get("skipped_update", 0) for r in rl)
        print(f"{summary['optimizer_steps']} optimizer steps in {len(rl)} RL steps"
              + (f" ({skipped} with every group zero-variance and dropped: no update)" if skipped else ""))
    if held.after_rl is not None:  # None: no eval ran (eval_before_rl off and no RL step), or none can (no gold)
        summary.update(accuracy_table(cfg, held))
    elif not held.task.has_gold and rank == 0:  # say why there is no table, and what was measured instead
        scores = [r["rm/score_mean"] for r in rl if "rm/score_mean" in r]
        print(f"held-out accuracy: not measured: the held-out prompts (eval_data={cfg.eval_data}) are prompt-only "
              f"rows, with no gold answer to grade"
              + (f"; the reward model's mean score of the RL rollouts went {scores[0]:.3f} -> {scores[-1]:.3f} "
                 f"(rm/score_mean in metrics.jsonl)" if scores else ""))
    if rank == 0:
        print(f"wrote {cfg.out_dir}/: the model in the HF hub layout (config.json, safetensors, tokenizer files), "
              f"run_config.json, metrics.jsonl, plot.png"
              f"{', ckpt/' if os.path.isdir(os.path.join(cfg.out_dir, 'ckpt')) else ''} "
              f"in {time.perf_counter() - t_start:.0f}s")
    return summary


def accuracy_table(cfg: TrainConfig, held: HeldOut) -> dict:
    """Held-out accuracy before RL (after SFT) and after, with the paired gain, printed by rank 0; after RL alone
    when eval_before_rl is off. Returns {"sampled": ..., "greedy": ..., and with tools run_eval's others}."""
    rank = rank_world()[0]
    before, after = held.before_rl, held.after_rl
    start = "after SFT" if cfg.sft_steps else "before RL"  # a checkpoint's run has no SFT warm-up
    if rank == 0:
        print(f"{f'held-out accuracy (n={len(held.items)} prompts)':<38}"
              + (f"{start:<17}{'after RL':<17}RL gain" if before is not None else "after RL (eval_before_rl off)"))
    table = {}
    for key, after_n in after.items():
        name = f"sampled (mean of {cfg.eval_samples}, T={cfg.sampling.temperature})" if key == "sampled" else key
        a1, s1 = mean_se(after_n)
        if before is None:
            table[key] = {"rl_acc": a1, "rl_se": s1}
            if rank == 0:
                print(f"{name:<38}{a1:.3f} +- {s1:.3f}")
            continue
        a0, s0 = mean_se(before[key])
        gain, paired_se = mean_se(after_n - before[key])  # same prompts before and after: a paired difference
        if rank == 0:
            print(f"{name:<38}{a0:.3f} +- {s0:.3f}   {a1:.3f} +- {s1:.3f}   {gain:+.3f} = "
                  f"{gain / max(paired_se, 1e-9):.1f} paired SE ({gain / max(math.hypot(s0, s1), 1e-9):.1f} unpaired)")
        table[key] = {"sft_acc": a0, "sft_se": s0, "rl_acc": a1, "rl_se": s1, "gain": gain,
                      "gain_paired_se": paired_se}
    return table
