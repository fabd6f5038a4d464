"""Zero-variance elimination: generated tokens per informative group, staged against DAPO dynamic sampling.

Both pipelines fill each step with `batch` informative groups (groups whose G rewards
differ), drawing prompts in rounds until the step is full (train.collect_rollouts, the first
half of an RL step, exactly as a run does it); they differ only in what runs before and
during generation:

- baseline, DAPO dynamic sampling (arXiv 2503.14476 sec. 3.2): every drawn prompt gets
  all G rollouts; zero-variance groups are dropped afterwards;
- staged (filter.py): stage 1 skips prompts last seen all-correct or all-wrong, stage 2
  generates k probes first and stops prompts whose probes agree, stage 3 drops the rest.

Two policies, each measured with both pipelines in the same run:

1. simulated: `--prompts` prompts with pass rates drawn from Beta(0.3, 0.3) (U-shaped:
   most prompts are nearly always or nearly never solved, as in RL datasets) and mean
   completion lengths lognormal around 400 tokens; a rollout's reward is Bernoulli(p);
2. the tiny model on its task (configs/tiny.py's model and tasks): `--sft-steps` of SFT
   from random init, or the weights of `--init-from` (a train.py output dir), then a
   pool of `--tiny-pool` prompts revisited over the steps, so stage 1 has a history: the
   default 1024 over 40 steps has DAPO draw each prompt about 4.6 times, as configs/tiny.py's
   350 steps go about 5 times over its 8000 prompts (a 512 pool is drawn so often that
   stage 1 soon skips most of it; 2048 leaves stage 1 little history).

Both policies are held fixed while measured (no RL updates), which favours stage 1: a
prompt's pass rate does not drift between visits. The zero-variance rate is reported
after each stage: the fraction of zero-variance groups among the prompts drawn (every
prompt with its full group: the baseline's), among the prompts that went to rollout
(a prompt stopped by its agreeing probes counts as zero-variance), among the groups
generated in full, and among the groups trained on (0: stage 3 drops the rest). Column
`short`: steps whose over-sampling rounds ran out before `batch` informative groups (a
skipped prompt costs nothing, but a round is a generate call; staged needs more rounds
than DAPO once stage 1 skips most of what is drawn, hence the default 60).

    python bench/zve.py [--steps 200 --tiny-steps 40 --tiny-pool 1024 --probes 4 --init-from out/tiny --threads 2]
        [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import random
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # the project, and bench/ (mismatch.py's helpers)
import train  # noqa: E402
from config import load_config  # noqa: E402
from data import Item, Task, Prompts, prompt_ids  # noqa: E402
from sampler import Rollout  # noqa: E402
from scheduler import LengthPredictor  # noqa: E402
from tokenizer import build_tokenizer, demo_tokenizer  # noqa: E402
from bench import smoke  # noqa: E402  (bench/smoke.py)

BETA = 0.3  # Beta(BETA, BETA) pass rates: U-shaped
MEAN_TOKENS = 400  # simulated completion length scale
LENGTH_SPREAD = 0.2  # a simulated completion's length: Gaussian around its prompt's mean, this fraction of it as std
ONE_CALL = 1 << 20  # generation rows per engine call: the simulated engine takes a round in one call
# --smoke: a few steps of 4 groups of 4 (2 probes), at most 2 rounds each, simulated and with the tiny model after
# one SFT step; one thread (two stall each other on busy shared cores)
SMOKE = {"prompts": 200, "steps": 3, "batch": 4, "group_size": 4, "probes": 2, "rounds": 2, "tiny_steps": 2,
         "tiny_pool": 16, "sft_steps": 1, "threads": 1}


class SimTask(Task):
    """Prompts "p{i}" with pass rate p_i: a rollout's reward is Bernoulli(p_i)."""

    def __init__(self, pass_rate: list[float], seed: int):
        self.items = [Item(f"p{i}", "", 0, i) for i in range(len(pass_rate))]
        self.pass_rate, self.gen = pass_rate, random.Random(seed)

    def score(self, completion, item):
        return float(self.gen.random() < self.pass_rate[item.index])

    def user_message(self, item):
        return item.question

    def demonstration(self, item):
        return ""  # never trained on: no SFT here


class SimEngine:
    """An engine whose rollouts have only a length: around their prompt's mean (ids of byte 0)."""
    weight_version = 0

    def __init__(self, mean_length: dict[tuple, float], seed: int):
        self.mean_length, self.gen = mean_length, random.Random(seed)

    def generate(self, prompts, params, *, n=1, seed=None, group_ids=None):
        out = []
        for p, g in zip(prompts, group_ids):
            mean = self.mean_length[tuple(p)]
            for _ in range(n):
                c = max(1, round(self.gen.gauss(mean, LENGTH_SPREAD * mean)))
                out.append(Rollout(list(p), [0] * c, torch.zeros(c), torch.zeros(0), "stop", g, 0, text=""))
        return out

    def phase(self):
        return contextlib.nullcontext()

    def memory(self) -> dict[str, int]:
        return {}

    def counters(self) -> dict[str, int]:
        return {}


def make_train_run(cfg, engine, tok, task, order, model=None) -> train.Run:
    """A train.Run over `task`'s prompts in `order`, with a fresh length predictor and stage-1 RNG (as train.start_run)."""
    return train.Run(cfg=cfg, engine=engine, tok=tok, model=model,
                     prompts=Prompts(task, order, tok, cfg.prompt_limit(), cfg.system_prompt),
                     predictor=LengthPredictor(prior=cfg.sampling.max_new_tokens / 2), filter_rng=random.Random(cfg.seed))


def stage_overrides(args, staged: bool) -> list[str]:
    """TrainConfig overrides of a pipeline: DAPO (over-sampling only) or staged (stages 1 and 2 on too)."""
    base = [f"group_size={args.group_size}", f"prompts_per_step={args.batch}", f"filter.oversample_rounds={args.rounds}",
            f"seed={args.seed}"]
    if not staged:
        return base
    return base + [f"filter.skip_prob={args.skip_prob}", f"filter.skip_half_life={args.half_life}",
                   f"filter.probe_size={args.probes}", f"filter.probe_stop_threshold={args.stop_threshold}"]


def run_pipeline(run: train.Run, *, steps: int) -> dict:
    """Totals over `steps` steps of train.collect_rollouts, plus the zero-variance rate after each stage."""
    t = {"rollouts": 0, "tokens": 0, "informative": 0, "drawn": 0, "rolled_out": 0, "rolled_out_zv": 0, "full": 0,
         "full_zv": 0, "skipped": 0, "stopped": 0, "steps_short": 0}
    for step in range(steps):
        with run.engine.phase():  # as train.rl_step runs it
            m, _ = train.collect_rollouts(run, step)
        stopped = m["filter/stage2_prompts_stopped"]  # a stopped prompt's group is its agreeing probes
        t["rollouts"] += m["filter/rollouts_generated"]
        t["tokens"] += m["filter/tokens_generated"]
        t["informative"] += m["filter/groups_informative"]
        t["steps_short"] += m["filter/groups_informative"] < run.cfg.prompts_per_step  # over-sampling ran out of rounds
        t["drawn"] += m["filter/prompts_drawn"]
        t["rolled_out"] += m["filter/groups"]
        t["rolled_out_zv"] += m["filter/groups_dropped"]
        t["full"] += m["filter/groups"] - stopped
        t["full_zv"] += m["filter/groups_dropped"] - stopped
        t["skipped"] += m["filter/stage1_prompts_skipped"]
        t["stopped"] += stopped
    t["tokens_per_informative"] = t["tokens"] / max(1, t["informative"])
    t["zv_after_stage1"] = t["rolled_out_zv"] / max(1, t["rolled_out"])
    t["zv_after_stage2"] = t["full_zv"] / max(1, t["full"])
    t["zv_after_stage3"] = 0.0
    return t


def compare(make_run, args, *, steps: int) -> dict:
    """Baseline and staged pipelines, each on a fresh run (same prompt order and policy)."""
    out = {}
    for name in ("dapo", "staged"):
        t0 = time.perf_counter()
        out[name] = run_pipeline(make_run(stage_overrides(args, staged=name == "staged")), steps=steps)
        out[name]["seconds"] = time.perf_counter() - t0
    out["dapo"]["zv_drawn"] = out["dapo"]["zv_after_stage1"]  # every drawn prompt went to rollout in full
    out["ratio"] = out["staged"]["tokens_per_informative"] / out["dapo"]["tokens_per_informative"]
    return out


def simulated(args) -> dict:
    rng = random.Random(args.seed)
    pass_rate = [rng.betavariate(BETA, BETA) for _ in range(args.prompts)]
    length = [rng.lognormvariate(math.log(MEAN_TOKENS), 0.5) for _ in range(args.prompts)]
    order = list(range(args.prompts))
    rng.shuffle(order)

    def make_run(overrides):
        cfg = load_config(None, overrides + [f"gen_batch_rows={ONE_CALL}", f"sampling.max_new_tokens={10 * MEAN_TOKENS}",
                                             f"model.max_seq_len={10 * MEAN_TOKENS + 256}"])  # room for prompts
        tok = demo_tokenizer(build_tokenizer(cfg.model.vocab_size))
        task = SimTask(pass_rate, args.seed + 1)
        mean_length = {tuple(prompt_ids(tok, task, it, cfg.system_prompt)): length[it.index] for it in task.items}
        return make_train_run(cfg, SimEngine(mean_length, args.seed + 2), tok, task, order)

    return compare(make_run, args, steps=args.steps)


def tiny(args) -> dict:
    """The tiny config's model after a short SFT (or --init-from), sampling its own task."""
    from model import Transformer
    from data import TaskMix, run_tokenizer
    # bench/mismatch.py: an earlier run's model and tokenizer, the engine, a short SFT
    from mismatch import load_run_output, make_engine, sft_here

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny_config = os.path.join(root, "configs", "tiny.py")
    cfg = load_config(tiny_config, [f"group_size={args.group_size}", "ckpt_every=0"])
    task = TaskMix(cfg.tasks, seed=cfg.train_seed, size=cfg.train_size)
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    if args.init_from:
        tok = load_run_output(args.init_from, model)
    else:  # the tokenizer draws nothing from torch's RNG: the engine's init below sees what it saw before
        tok = run_tokenizer(cfg, task)  # the demo's own BPE, learned from the task as a run learns it
    engine = make_engine(cfg, tok)
    if not args.init_from:
        sft_here(dataclasses.replace(cfg, sft_steps=args.sft_steps), task, tok, model, engine)
    engine.update_weights(model.named_parameters(), version=0)

    def make_run(overrides):
        run_cfg = load_config(tiny_config, overrides)
        return make_train_run(run_cfg, engine, tok, task, list(range(args.tiny_pool)), model=model)

    return compare(make_run, args, steps=args.tiny_steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4000, help="simulated prompts")
    ap.add_argument("--steps", type=int, default=200, help="simulated steps")
    ap.add_argument("--batch", type=int, default=64, help="informative groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--probes", type=int, default=4, help="stage 2 probe rollouts k")
    ap.add_argument("--stop-threshold", type=float, default=0.5,
                    help="stage 2 stops agreeing probes when the rest agree with at least this chance")
    ap.add_argument("--skip-prob", type=float, default=1.0, help="stage 1 skip probability")
    ap.add_argument("--half-life", type=float, default=200.0, help="stage 1 half-life in steps")
    ap.add_argument("--rounds", type=int, default=60, help="over-sampling rounds per step")
    ap.add_argument("--tiny-steps", type=int, default=40, help="steps with the tiny model (0 = skip it)")
    ap.add_argument("--tiny-pool", type=int, default=1024, help="tiny-model prompts revisited over its steps")
    ap.add_argument("--sft-steps", type=int, default=350, help="SFT steps from random init (without --init-from)")
    ap.add_argument("--init-from", default="", help="a train.py output dir to take the tiny model from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = smoke.parse_args(ap, SMOKE)
    torch.set_num_threads(args.threads)
    results = {"config": vars(args), "simulated": simulated(args)}
    if args.tiny_steps:
        results["tiny"] = tiny(args)
    print(f"{'policy':<11}{'pipeline':<9}{'rollouts':>10}{'tokens':>12}{'informative':>13}{'tok/inf':>9}"
          f"{'skipped':>9}{'stopped':>9}{'short':>7}   zero-variance rate: drawn / after stage 1 / 2 / 3")
    for policy in ("simulated", "tiny"):
        for name in ("dapo", "staged"):
            if policy not in results:
                continue
            r = results[policy][name]
            drawn = f"{r['zv_drawn']:.3f}" if "zv_drawn" in r else "  -  "
            print(f"{policy:<11}{name:<9}{r['rollouts']:>10}{r['tokens']:>12}{r['informative']:>13}"
                  f"{r['tokens_per_informative']:>9.1f}{r['skipped']:>9}{r['stopped']:>9}{r['steps_short']:>7}   {drawn} / "
                  f"{r['zv_after_stage1']:.3f} / {r['zv_after_stage2']:.3f} / {r['zv_after_stage3']:.3f}")
    smoke.write_results(args, "zve", results)
    tiny_note = f"; tiny model: {results['tiny']['ratio']:.2f}x" if "tiny" in results else ""
    print(f"{results['simulated']['ratio']:.2f}x generated tokens per informative group, staged vs DAPO dynamic sampling "
          f"(simulated Beta({BETA}, {BETA}) pass rates{tiny_note}; target <= 0.7x)")


if __name__ == "__main__":
    main()
