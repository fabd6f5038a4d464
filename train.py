"""Entry point and the RL step, top to bottom: `python train.py configs/tiny.py [key=value ...]`.

A run is a short cold-start SFT warm-up on the task's demonstrations (the seed paper, arXiv
2512.07710, also starts RL from an SFT model), then RL steps. One RL step (`rl_step`) follows
the seed paper's figure; each line is one call into the file that owns it:

    draw prompts -> [stage 1: skip prompts recently all-correct or all-wrong]      data.py, filter.py
      -> batch them by prompt and predicted completion length                     scheduler.py
      -> generate G rollouts per prompt: tokens, logprobs, routed experts         rollout.py
         [stage 2: k probes first; the other G - k only where the probes differ]  filter.py
      -> score them (the verifier)                                                scoring.py, reward.py
      -> [over-sampling: more prompts while the step lacks informative groups]    filter.py
      -> [shape the rewards inside the correctness class]                         shaping.py, reward.py
      -> stage 3: drop zero-variance groups [or keep them with RL-ZVP]            filter.py
      -> group-relative advantages                                                espo.py
      -> policy update: pi_old, ESPO loss with the routes replayed, AdamW         trainer.py
      -> weight sync to the engine                                                rollout.py
      -> log (metrics.jsonl), eval, checkpoint

Bracketed parts are off by default (the config's `filter` and `reward` sections). Before the
first step `main` reads every file the run needs once (`prepare`). With
`max_staleness` k > 0 the first half (`collect_rollouts`) runs on a producer thread up to k
steps ahead of the second (`update_policy`): `rl_loop_async`. Under torchrun every rank runs
this file; distributed.py holds what differs. The README's "Reading order" says where to go next.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from checkpoint import (check_run_folder, latest_checkpoint, lock_run_folder, read_checkpoint, resume_checkpoint,
                        rng_state, run_bytes, save_model, set_rng_state, write_checkpoint)
from config import ConfigError, TrainConfig, parse_args
from data import Item, Prompts, RunData, load_run_data
from distributed import Meshes, all_gather_list, build_model, rank_world, reference_copy, setup_distributed
from espo import ragged_group_advantages
from evaluation import HeldOut, run_eval, summarize
from filter import (STAGE1_COUNTS, STAGE2_COUNTS, PromptHistory, Scored, is_informative, oversample_size,
                    pre_rollout_filter, probe_decisions, stage3)
from hf import check_weights
from metrics import MetricsLog, WriteError, check_logger, read_records, write_atomic
from plan import param_counts
from reward_model import check_scorer_context, reward_model_for, scorer_model_config
from rollout import Engine, build_engine, engine_builder, judge_generator, producer_engine, stop_engine_servers
from sampler import Rollout, texts
from scheduler import LengthPredictor, Pipeline, generation_batches
from scoring import RewardPool, score_inline
from shaping import (BlindScorerError, ScorerQueue, UnusableStreak, scores_collectively, shape_rewards,
                     submit_groups)
from tool_rollout import demonstration_ids
from trainer import NonFiniteError, TrainBatch, lr_at, sft_step, train_on_rollouts
from weights import full_tensor, policy_tensors

if TYPE_CHECKING:
    from model import ModelConfig
    from reward import Scorer
    from tokenizer import Tokenizer

STEP_SEED_STRIDE = 1000  # seed offset between RL steps' rollouts (cfg.seed + step, spread apart)
ROUND_SEED_STRIDE = 1_000_000_000  # seed offset between a step's generate rounds (probes, the rest, over-sampling)
ROLLOUT_TIMEOUT_S = 3600.0  # async loop: a producer silent this long is taken as hung


@dataclass
class Run:
    """What a run carries from step to step, built once (`start_run`). Its settings are cfg's sections
    (cfg.loss, cfg.filter, cfg.reward, cfg.sampling, ...), read where they are used."""
    cfg: TrainConfig
    engine: Engine  # generates rollouts (rollout.build_engine); follows every policy update
    tok: Tokenizer
    prompts: Prompts
    # State the rollout side changes step by step, checkpointed and restored on resume. Plain fields, so the
    # async producer's view of the run (dataclasses.replace(run, engine=...)) holds these very objects.
    predictor: LengthPredictor  # completion lengths, for length-bucketed generation and stage 1's estimates
    filter_rng: random.Random  # stage 1's draws only, apart from torch's RNG
    history: PromptHistory = field(default_factory=PromptHistory)  # each prompt's last pass rate (stages 1, 2)
    model: torch.nn.Module | None = None  # the policy (FSDP/EP-sharded under torchrun)
    opt: torch.optim.Optimizer | None = None  # the RL optimizer (SFT has its own)
    ref_model: torch.nn.Module | None = None  # the KL penalty's frozen reference
    held_out: HeldOut | None = None  # the eval prompts, their task (verifier) and accuracies before and after RL
    log: MetricsLog = field(default_factory=MetricsLog)  # in memory only, unless given an out_dir
    pool: RewardPool | None = None  # reward workers that score while generation goes on
    scorer: Scorer | None = None  # reward model or judge (reward_model.reward_model_for), None without one
    scorer_queue: ScorerQueue | None = None  # with reward workers: the scorer at work while generation goes on
    unusable: UnusableStreak | None = None  # steps in a row of mostly unusable scorer outputs (shaping's choice 5);
    # None: one for cfg.reward.model (__post_init__), so the async producer's replaced view shares the run's
    t_start: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        if self.unusable is None:  # a Run built apart from start_run (tests, bench/)
            self.unusable = UnusableStreak(self.cfg.reward.model)


# ----------------------------------------------------------------------------- the RL step

def rl_step(run: Run, step: int) -> dict:
    """One synchronous RL step: collect_rollouts, then update_policy. Returns its metrics."""
    with run.engine.phase():  # the sharded policy's weights gathered for the rollouts, freed before training
        m, batch = collect_rollouts(run, step)
    if batch is None:  # every group was zero-variance and dropped: nothing to learn from this step
        m["skipped_update"], m["optimizer_steps"] = 1, 0
        return m
    m.update(update_policy(run, batch, step))
    return m


def collect_rollouts(run: Run, step: int) -> tuple[dict, TrainBatch | None]:
    """The first half of an RL step: prompts -> scored groups -> advantages, as a TrainBatch (None when
    every group was dropped), and metrics. Never changes the policy, so the async loop runs it on its
    producer thread. Callers run it inside one rollout phase of the engine (on the sharded policy the
    weights are gathered once for all of its generate calls)."""
    cfg = run.cfg
    t0 = time.perf_counter()
    groups, counts = draw_groups(run, step)  # generated and scored: (item, [Scored]) in draw order
    t_generate = time.perf_counter() - t0
    for item, g in groups:  # every completion teaches the length predictor (generation buckets, stage 1's estimates)
        for s in g:
            run.predictor.observe(item.question, s.num_tokens, task=item.task, prompt_len=s.rollout.prompt_len)
    correct = [torch.tensor([s.reward for s in g]) for _, g in groups]  # the verifier's 0/1
    # shaping (penalties, reward model, judge) moves a reward only inside its correctness class, so no
    # correct response can get a negative advantage (shaping.adjust_rewards)
    rewards, shaping = (shape_rewards(groups, correct, step, cfg=cfg.reward, scorer=run.scorer,
                                      queue=run.scorer_queue, max_new_tokens=cfg.sampling.max_new_tokens)
                        if cfg.reward.shapes else (correct, {}))
    run.unusable.observe(step, shaping)  # a scorer that cannot see what it scores warns, then stops the run
    lengths = [torch.tensor([s.num_tokens for s in g]) for _, g in groups]
    keep_P, zero_var_P, filtered = stage3(rewards, lengths, correct, cfg.filter)  # all equal: no signal
    # A = (r - mean) / std within each group (GRPO, arXiv 2402.03300); groups differ in size when stage 2
    # stopped some at their probes. Rollouts are group-major, so the concatenation lines up with them; no
    # group at all when stage 1 skipped every prompt drawn
    adv = torch.cat(ragged_group_advantages(rewards, scale_by_std=cfg.loss.adv_scale_by_std,
                                            std_over=cfg.loss.adv_std_over) or [torch.zeros(0)])
    m = rollout_metrics(step, groups, correct, lengths, {**filtered, **counts}, t_generate)
    m.update(shaping)
    m.update({f"engine/{k}_bytes": v for k, v in run.engine.memory().items()})  # this rank's: no replica if sharded
    m.update({f"engine/{k}": v for k, v in run.engine.counters().items()})  # e.g. rows preempted for KV pages
    return m, kept_batch(run, groups, keep_P, zero_var_P, adv)


def draw_groups(run: Run, step: int) -> tuple[list[tuple[Item, list[Scored]]], dict]:
    """The step's prompts, each with its group of scored rollouts, in draw order, and the counts of stages 1 and 2
    and over-sampling. By default one round: prompts_per_step prompts, group_size rollouts each. Stage 1
    (filter.skip_prob) skips prompts last seen all-correct or all-wrong; stage 2 (filter.probe_size) generates k
    probes first and the rest only where they disagree; over-sampling (filter.oversample_rounds, DAPO's dynamic
    sampling) draws more prompts while informative groups are missing."""
    cfg, filt = run.cfg, run.cfg.filter
    groups = []  # (item, [Scored]) in draw order: what the stages have kept so far
    gen_rounds = itertools.count()  # numbers the step's generate rounds, so each draws its own random numbers
    drawn = 0  # prompts drawn this step: over-sampling's informative rate is over these
    stage1, stage2 = Counter({k: 0 for k in STAGE1_COUNTS}), Counter({k: 0 for k in STAGE2_COUNTS})
    items, rounds = run.prompts.draw(cfg.prompts_per_step), 0
    for rnd in range(filt.oversample_rounds + 1):
        if rnd:  # over-sampling: more prompts while groups are missing
            more = oversample_size([g for _, g in groups], drawn, cfg.prompts_per_step, filt)
            if not more:
                break
            items, rounds = run.prompts.draw(more), rnd
        drawn += len(items)
        if filt.skip_prob > 0:  # stage 1, before rollout
            # each prompt's predicted completion tokens: its own history, else its task's at its prompt length
            predicted = [run.predictor.predict(it.question, task=it.task, prompt_len=len(run.prompts.ids[it.question]))
                         for it in items]
            keep, counts = pre_rollout_filter([it.question for it in items], run.history, step, filt,
                                              group_size=cfg.group_size, rng=run.filter_rng,
                                              predicted_tokens=predicted)
            items = [it for it, k in zip(items, keep) if k]
            stage1.update(counts)
        if not items:
            continue
        if filt.probe_size:  # stage 2, during rollout
            new = sample_groups(run, items, filt.probe_size, step, next(gen_rounds))
            go_on, counts = probe_decisions(new, [run.history.records.get(it.question) for it in items], filt,
                                            group_size=cfg.group_size)
            if go_on:
                rest = sample_groups(run, [items[i] for i in go_on], filt.rest_size(cfg.group_size), step,
                                     next(gen_rounds))
                for i, extra in zip(go_on, rest):
                    new[i] = new[i] + extra  # probes first, in order
            stage2.update(counts)
        else:
            new = sample_groups(run, items, cfg.group_size, step, next(gen_rounds))
        if filt.skip_prob > 0 or filt.probe_size:  # what stages 1 and 2 read next time (a stopped prompt: its probes)
            for it, g in zip(items, new):
                run.history.observe(it.question, sum(s.reward for s in g) / len(g), step, n=len(g))
        groups += zip(items, new)
    counts = {**{f"stage1_{k}": v for k, v in stage1.items()}, **{f"stage2_{k}": v for k, v in stage2.items()},
              "oversample_rounds": rounds, "prompts_drawn": drawn,
              "groups_informative": sum(is_informative(g) for _, g in groups)}
    return groups, counts


def update_policy(run: Run, batch: TrainBatch, step: int) -> dict:
    """The second half of an RL step: the policy update (trainer.py), then weight sync to the engine."""
    t0 = time.perf_counter()
    run.engine.sleep()  # a colocated SGLang engine gives its GPU memory back while the trainer trains
    m = train_on_rollouts(run.model, run.opt, batch, step, run.cfg, run.ref_model)
    run.engine.wake()
    # version = RL steps trained (policy updates): the next step's rollouts record which weights produced them
    run.engine.update_weights(policy_tensors(run.model), version=step + 1)
    m["t_train"] = time.perf_counter() - t0
    m["trained_sequences"] = len(batch.all_lens)  # every rank's
    return m


# ----------------------------------------------------------------------------- the step's pieces

def sample_groups(run: Run, items: list[Item], n: int, step: int, gen_round: int) -> list[list[Scored]]:
    """n scored rollouts of each item: generate, then score."""
    rollouts = generate_rollouts(run, items, n, step, gen_round)
    return score_rollouts(run, rollouts, items, n, gen_round)


def generate_rollouts(run: Run, items: list[Item], n: int, step: int, gen_round: int) -> list[Rollout]:
    """n rollouts of each item from the engine, in batches of similar predicted length (scheduler.py);
    with reward workers each batch is handed to them (and to the scorer's queue) as soon as it is generated.
    With continuous batching (engine.slots) one batch holds every item: one call per rank, the engine keeping
    `slots` rows live.

    gen_round: which of the step's generate rounds this is (probes, the rest, over-sampling), so each
    draws its own random numbers. A rollout's random stream is keyed by (step, gen_round, group id,
    sample index) alone (sampling is batch-invariant), so how prompts are batched, and on which
    rank, does not change what is sampled. Multi-rank: each batch spans every rank, each rank
    generates its share (all ranks in the same calls, in lockstep) and returns only its own rollouts.
    """
    cfg = run.cfg
    prompts = [run.prompts.ids[it.question] for it in items]
    rank, world = rank_world()
    seed = (cfg.seed + step) * STEP_SEED_STRIDE + gen_round * ROUND_SEED_STRIDE
    rollouts = []
    # prompts per batch and rank: gen_batch_rows' worth, or with engine.slots all of them (the engine bounds the
    # rows live at once; the scheduler only deals the prompts over the ranks, longest first, for balance)
    per_call = max(1, len(items)) if cfg.engine.slots else max(1, cfg.gen_batch_rows // n)
    for share in generation_batches(run.predictor, [(it.question, it.task, len(p)) for it, p in zip(items, prompts)],
                                    per_call, num_ranks=world, rank=rank):
        # share: this rank's indices into items (maybe none), which become the rollouts' group ids
        generated = run.engine.generate([prompts[i] for i in share], cfg.sampling, n=n, group_ids=share, seed=seed)
        completions = texts(generated)  # what the verifier and the scorer read
        if run.pool is not None:  # rollouts of a prompt come out in order, so (gen_round, group, j) names each one
            for j, (r, text) in enumerate(zip(generated, completions)):
                run.pool.submit((gen_round, r.group_id, j % n), text, items[r.group_id])
        if run.scorer_queue is not None:  # the reward model or judge too (shaping's choice 3)
            submit_groups(run.scorer_queue, generated, items, n)
        rollouts += generated
    rollouts.sort(key=lambda r: r.group_id)  # stable: keeps each group's sample order
    return rollouts


def score_rollouts(run: Run, rollouts: list[Rollout], items: list[Item], n: int, gen_round: int) -> list[list[Scored]]:
    """The verifier's reward of each rollout (waiting for the reward workers, if any), as groups of n
    per item. Multi-rank: every rank learns every rollout's reward and lengths (a RolloutSummary as the
    rollout of the others'), so filter, advantages and history agree; tokens and routes stay on
    the rank that generated them (with reward shaping, the completions' ids travel too)."""
    if run.pool is not None:
        mine = sorted({r.group_id for r in rollouts})
        rewards, reasons = run.pool.gather([(gen_round, i, j) for i in mine for j in range(n)])
    else:
        # on this thread, each bounded by reward.timeout_s as a worker's would be
        results = [score_inline(run.prompts.task.score, r.text, items[r.group_id], timeout_s=run.cfg.reward.timeout_s)
                   for r in rollouts]
        rewards, reasons = [w for w, _ in results], [why for _, why in results]
    scored = [Scored(reward=w, num_tokens=len(r.completion_ids), rollout=r, reason=why)
              for w, r, why in zip(rewards, rollouts, reasons)]
    rank, world = rank_world()
    if world > 1:
        tokens = run.cfg.reward.shapes
        everyone = all_gather_list([dataclasses.replace(s, rollout=s.rollout.summary(rank, tokens)) for s in scored])
        mine = iter(scored)  # this rank's part of the gathered list, in the same order: keep the full rollouts
        scored = [next(mine) if s.rollout.rank == rank else dataclasses.replace(s, local=False) for s in everyone]
        scored.sort(key=lambda s: s.rollout.group_id)  # stable: a group is generated on one rank, in sample order
    # sorted by group id, n per group and the sort stable: group i is the i-th slice of n, in sample order
    return [scored[i * n:(i + 1) * n] for i in range(len(items))]


def kept_batch(run: Run, groups, keep_P: torch.Tensor, zero_var_P: torch.Tensor, adv: torch.Tensor):
    """The rollouts of the kept groups as a TrainBatch (None if none is kept); zero-variance groups kept
    for RL-ZVP are marked with their correctness (the trainer makes their token advantages)."""
    every = [(p, s) for p, (_, g) in enumerate(groups) for s in g]  # (group, scored rollout), group-major as adv
    kept = [(k, p, s) for k, (p, s) in enumerate(every) if keep_P[p]]  # k: the rollout's index into adv
    if not kept:
        return None
    mine = [j for j, (_, _, s) in enumerate(kept) if s.local]  # this rank's, numbered among every rank's kept ones
    r = [kept[j][2].rollout for j in mine]
    # a zero-variance group is all correct or all wrong: one rollout's reward says which (RL-ZVP's sign)
    zvp = {a: kept[j][2].reward > 0 for a, j in enumerate(mine) if zero_var_P[kept[j][1]]}
    return TrainBatch(seqs=[x.prompt_ids + x.completion_ids for x in r], starts=[x.prompt_len for x in r],
                      routes=[x.routes for x in r], adv_B=adv[[kept[j][0] for j in mine]],
                      infer_logp=[x.logprobs for x in r], loss_masks=[x.loss_mask for x in r], zvp=zvp,
                      pad_id=run.tok.pad_id, ids=mine,
                      # trained tokens only (a Rollout's or another rank's RolloutSummary's): the token-mean normaliser
                      all_lens=[s.rollout.num_trained for _, _, s in kept])


def rollout_metrics(step: int, groups, correct, lengths, filtered: dict, t_generate: float) -> dict:
    """The first half's metrics: reward, lengths, what each filter stage saved, scoring failures, weight versions."""
    scored = [s for _, g in groups for s in g]
    if not scored:  # stage 1 skipped every prompt drawn: only its counts to report
        return {"stage": "rl", "step": step, "t_generate": t_generate,
                **{f"filter/{k}": v for k, v in filtered.items()},
                "filter/rollouts_generated": 0, "filter/tokens_generated": 0}
    length = torch.cat(lengths)
    versions = [s.rollout.weight_version for s in scored]
    return {"stage": "rl", "step": step, "reward": torch.cat(correct).mean().item(),
            "completion_len": length.float().mean().item(),
            "stop_frac": sum(s.rollout.finish_reason == "stop" for s in scored) / len(scored), "t_generate": t_generate,
            **{f"filter/{k}": v for k, v in filtered.items()},
            "filter/rollouts_generated": len(scored), "filter/tokens_generated": int(length.sum()),
            "reward/timeouts": sum(s.reason == "timeout" for s in scored),
            "reward/errors": sum(s.reason.startswith("error") for s in scored),
            "weight_version_min": min(versions), "weight_version_max": max(versions)}


# ----------------------------------------------------------------------------- the loops

def rl_loop(run: Run, start: int):
    """RL steps start..rl_steps - 1 (synchronous, or async with max_staleness > 0): log, eval, checkpoint."""
    cfg = run.cfg
    bar = tqdm(range(start, cfg.rl_steps), desc="rl", dynamic_ncols=True, initial=start, total=cfg.rl_steps,
               disable=rank_world()[0] != 0)
    steps = None
    if cfg.max_staleness:  # before a checkpoint the producer waits for the newest weights: nothing generated ahead
        steps = rl_loop_async(run, start, sync_after=lambda s: ckpt_due(cfg, cfg.sft_steps + s + 1))
    for step in bar:
        m = next(steps) if steps is not None else rl_step(run, step)
        m["time"] = time.perf_counter() - run.t_start
        run.log(m)
        # the verifier's mean reward, or with reward.rm_only (no verifier read) the reward model's shaped one
        shown = "reward/shaped_mean" if cfg.reward.rm_only else "reward"
        bar.set_postfix(reward=f"{m.get(shown, math.nan):.2f}", zv=f"{m['filter/zero_variance_frac']:.2f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.rl_steps:
            run.held_out.after_rl = run_eval(run.engine, run.tok, run.held_out, cfg, run.log, step + 1, run.t_start)
        checkpoint(run, run.opt, "rl", step)
    if steps is not None:
        steps.close()


def rl_loop_async(run: Run, start: int = 0, sync_after=None):
    """RL steps start..rl_steps - 1 with rollouts up to cfg.max_staleness weight versions old; yields each
    step's metrics. Under torchrun the producer decodes on a sharded copy of the policy with process
    groups of its own (`producer_engine`), loading each published version shard by shard.

    A producer thread (scheduler.Pipeline) runs collect_rollouts for steps s+1..s+k on its own engine
    copy while the trainer runs update_policy for step s. After each step the trainer publishes a
    snapshot of its weights as version s + 1; the producer loads the newest one between steps and
    never starts step s with a version older than s - k, so every rollout of step s has weight
    version in [s - k, s] (`async/staleness_max` <= k). run.engine (used for evals) follows the
    trainer on the trainer thread. Prompts are drawn by the producer in step order, so each step's
    prompts are the synchronous loop's; the numbers are not, since rollouts come from older weights.

    Checkpoints: after a step s with sync_after(s) true the producer has drawn and generated nothing
    of step s + 1 (Pipeline's sync_before), and the new weights are published only when the caller
    asks for the next step, so a checkpoint written in between holds a state no rollout has run
    ahead of. Resuming continues the run validly, not bitwise (which weights a step's rollouts get
    depends on thread timing).

    Threads: two full OpenMP teams on the same CPU cores spin against each other, so on CPU the
    producer takes cfg.rollout_threads and the trainer cfg.trainer_threads (0 = half each).
    Raises whatever the producer raised, or TimeoutError if no batch arrives in ROLLOUT_TIMEOUT_S.
    """
    cfg = run.cfg
    # the producer's view of the run: its own engine; prompts, history, predictor and filter RNG are the very
    # objects the trainer's run holds (only the producer changes them during RL; the trainer checkpoints them
    # while the producer waits, Pipeline's sync_before)
    producer = dataclasses.replace(run, engine=producer_engine(run.engine, cfg, run.model))
    threads = torch.get_num_threads()
    rollout_threads, trainer_threads = cfg.rollout_threads, cfg.trainer_threads
    if torch.device(cfg.device).type == "cpu":  # split the cores; on a GPU each thread only launches work
        rollout_threads = rollout_threads or max(1, threads // 2)
        trainer_threads = trainer_threads or max(1, threads - rollout_threads)
    if trainer_threads:
        torch.set_num_threads(trainer_threads)

    def produce(step):  # on the producer thread
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.set_device(cfg.device)  # the current GPU is per thread: a new one starts on cuda:0
        if rollout_threads:
            torch.set_num_threads(rollout_threads)  # OpenMP teams are per thread
        t = time.perf_counter()
        with producer.engine.phase():  # on the sharded policy its collectives run on the producer's own groups
            m, batch = collect_rollouts(producer, step)
        m["t_rollout"] = time.perf_counter() - t
        return m, batch

    def apply(weights, version):  # on the producer thread, between its steps
        producer.engine.update_weights(weights.items(), version=version)

    sync_after = sync_after or (lambda step: False)
    # sync_before(s): the producer may start step s only once the weights of step s - 1 are published
    pipe = Pipeline(produce, apply, steps=cfg.rl_steps, max_staleness=cfg.max_staleness, start_step=start,
                    start_version=run.engine.weight_version, timeout=ROLLOUT_TIMEOUT_S,
                    sync_before=lambda step: sync_after(step - 1))
    try:
        for step in range(start, cfg.rl_steps):
            t0 = time.perf_counter()
            m, batch = pipe.next()
            m["async/wait"] = time.perf_counter() - t0  # trainer idle, waiting for rollouts
            if "weight_version_min" in m:  # absent when stage 1 skipped every prompt
                m["async/staleness_max"] = step - m["weight_version_min"]
                m["async/staleness_min"] = step - m["weight_version_max"]
            if batch is None:
                m["skipped_update"] = 1
            else:
                m.update(update_policy(run, batch, step))
            yield m  # the caller logs, evaluates and checkpoints before the producer sees these weights
            # a snapshot, so the trainer's next steps cannot change weights the producer is loading
            pipe.publish({n: t.clone() for n, t in policy_tensors(run.model)}, version=step + 1)
    finally:
        pipe.close()
        torch.set_num_threads(threads)


def sft(run: Run, opt, start: int):
    """Cold-start SFT on the task's demonstrations, steps start..sft_steps - 1."""
    cfg, tok = run.cfg, run.tok
    bar = tqdm(range(start, cfg.sft_steps), desc="sft", dynamic_ncols=True, initial=start, total=cfg.sft_steps,
               disable=rank_world()[0] != 0)
    for step in bar:
        items = run.prompts.draw(cfg.sft_batch_size)
        prompts = [run.prompts.ids[it.question] for it in items]
        # the demonstration's ids and loss mask: its answer, or with tools a calculator call first (0 at the tool turn)
        demos = [demonstration_ids(tok, cfg.tools, cfg.model.hf_model_type, it, run.prompts.task.demonstration(it))
                 for it in items]
        seqs = [p + ids for p, (ids, _) in zip(prompts, demos)]
        lr = lr_at(step, cfg.sft_lr, cfg.lr_warmup_steps, cfg.sft_steps, cosine=True)
        loss = sft_step(run.model, opt, seqs, [len(p) for p in prompts], tok.pad_id, lr, cfg, step=step,
                        loss_masks=[mask for _, mask in demos])
        bar.set_postfix(loss=f"{loss:.3f}")
        run.log({"stage": "sft", "step": step, "loss": loss, "lr": lr})
        checkpoint(run, opt, "sft", step)


def sft_optimizer(model, cfg: TrainConfig):
    """The SFT warm-up's AdamW (its own: the RL optimizer starts fresh after SFT)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def rl_optimizer(model, cfg: TrainConfig):
    """The RL AdamW (betas as the SFT's; its learning rate is set every step by trainer.lr_at)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


# ----------------------------------------------------------------------------- a run: build, resume, finish

def ckpt_due(cfg: TrainConfig, position: int) -> bool:
    """A checkpoint is written after `position` steps (SFT steps and RL steps counted together)."""
    return bool(cfg.ckpt_every) and position % cfg.ckpt_every == 0


def checkpoint(run: Run, opt, stage: str, step: int):
    """Write a checkpoint after `step` of `stage` ("sft" or "rl") if one is due."""
    position = step + 1 if stage == "sft" else run.cfg.sft_steps + step + 1  # steps so far, SFT and RL
    if not ckpt_due(run.cfg, position):
        return
    state = {"stage": stage, "step": step, "position": position, "used": run.prompts.used, "rng": rng_state(),
             "filter_rng": run.filter_rng.getstate(), "history": run.history.state_dict(),
             "predictor": run.predictor.state_dict(), "num_records": len(run.log.records), "evals": {"after_sft": run.held_out.before_rl, "after_rl": run.held_out.after_rl},
             "ref_model": {n: full_tensor(t) for n, t in policy_tensors(run.ref_model)}
             if run.ref_model is not None else None}
    write_checkpoint(run.cfg.out_dir, position, run.model, opt, state, run.cfg)


@dataclass
class Start:
    """What a run starts from, read and checked once before any work (`prepare`, `resume_checkpoint`)."""
    data: RunData  # tasks, tokenizer, training prompts and the held-out items (data.load_run_data)
    history: PromptHistory  # stages 1-2's records: the offline pass rates, if any (a resumed run's replace them)
    offline_rates: int = 0  # rows of filter.pass_rate_file read into history
    ckpt: str | None = None  # the checkpoint folder the run resumes from (None: afresh) and its trainer state
    resumed: dict | None = None
    scorer_model: ModelConfig | None = None  # the reward model's or judge's shape (reward_model.scorer_model_config)


def prepare(cfg: TrainConfig) -> Start:
    """Every file the run reads, read once and checked before any work (a dry run's too): out_dir (writable,
    room for all the run writes there, the final model included: checkpoint.run_bytes; apart from the init
    checkpoint, no live run in it, no other run's checkpoints: checkpoint.check_run_folder), the logger (its
    package, a wandb login), the metrics.jsonl a resume continues, the checkpoint's weights (headers), data and
    tokenizer (data.load_run_data), the offline pass rates, and reward.model's config.json
    (reward_model.scorer_model_config: the plan sizes it; its context must hold the run's longest prompt and
    completion, reward_model.check_scorer_context). Leaves nothing written.
    Raises ValueError naming the field (and the file)."""
    # a dry run plans for another machine: this one's free space says nothing of that one's
    needed = None if cfg.dry_run else run_bytes(cfg, param_counts(cfg.model)["total"])
    check_run_folder(cfg, needed, lock=os.environ.get("RANK", "0") == "0")  # rank 0 takes the lock (main)
    check_logger(cfg.logger)
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    if cfg.resume and os.path.isfile(metrics):
        read_records(metrics)  # a partial last line is dropped, but a bad line inside is named now, not at its turn
    for key in ("init_hf", "init_from"):
        if getattr(cfg, key):
            check_weights(f"{key}={getattr(cfg, key)!r}", getattr(cfg, key))
    if cfg.engine.name == "sglang" and not cfg.engine.urls and torch.cuda.is_available():
        # a colocated server sized before it starts: the fraction the plan allows, or the user's checked against it
        from plan import colocated_sglang
        world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
        share = colocated_sglang(cfg, world, torch.cuda.get_device_properties(local).total_memory)
        cfg.engine = dataclasses.replace(cfg.engine, sglang_mem_fraction=share["fraction"])
    start = Start(data=load_run_data(cfg), history=PromptHistory(), scorer_model=scorer_model_config(cfg.reward))
    if start.scorer_model is not None:
        check_scorer_context(cfg.reward, start.scorer_model, prompt_tokens=cfg.prompt_limit(),
                             completion_tokens=cfg.sampling.max_new_tokens)
    if cfg.filter.pass_rate_file:
        try:
            start.offline_rates = start.history.load_offline(cfg.filter.pass_rate_file)
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:  # a folder, bad bytes, a bad row
            raise ValueError(f"filter.pass_rate_file={cfg.filter.pass_rate_file!r}: {e}") from None
    return start


def start_run(cfg: TrainConfig, start: Start, meshes: Meshes | None) -> Run:
    """The policy, engine, metrics log and reward workers of a run, around what `prepare` read."""
    data = start.data
    if rank_world()[0] == 0:  # whole or not at all: a crash or a full disk leaves the previous one
        write_atomic(os.path.join(cfg.out_dir, "run_config.json"), json.dumps(dataclasses.asdict(cfg), default=str,
                                                                              indent=1))
    model = build_model(cfg, meshes)  # before the engine: both draw their init from torch's RNG
    engine = build_engine(cfg, data.tok, model)
    scorer = reward_model_for(cfg.reward, device=cfg.device, judge_generator=judge_generator(cfg))
    return Run(cfg=cfg, engine=engine, tok=data.tok, prompts=data.prompts,
               predictor=LengthPredictor(prior=cfg.sampling.max_new_tokens / 2), filter_rng=random.Random(cfg.seed),
               history=start.history, model=model, held_out=HeldOut(data.held_out, data.eval_items),
               log=MetricsLog(cfg.out_dir, logger=cfg.logger, config=dataclasses.asdict(cfg), write=rank_world()[0] == 0,
                              keep=start.resumed["num_records"] if start.resumed else None),
               pool=RewardPool(data.task.score, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
               if cfg.reward.workers else None, scorer=scorer,
               scorer_queue=ScorerQueue(scorer) if scorer is not None and cfg.reward.workers and not
               scores_collectively(scorer) else None)  # a sharded one scores collectively (shaping's choice 4)


def run(cfg: TrainConfig, start: Start, meshes: Meshes | None = None) -> dict:
    """main's body once the config and the files are checked and the process group (if any) is up."""
    rank, world = rank_world()
    if rank == 0:
        print(json.dumps(dataclasses.asdict(cfg), default=str))  # the resolved config
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)  # the policy's init; sampling and data order have their own seeded streams
    ckpt, resumed = start.ckpt, start.resumed
    try:
        r = start_run(cfg, start, meshes)
    except ValueError as e:  # what only building the run could find (a checkpoint's tensors): still before any work
        raise ConfigError(str(e)) from e
    if rank == 0:
        print(f"model: {sum(p.numel() for p in r.model.parameters()) / 1e6:.2f}M params; {len(r.prompts.task)} train "
              f"prompts, {len(r.held_out.items)} held-out prompts" + (f"; {world} ranks (ep={cfg.ep})" if world > 1 else "")
              + (f"; resuming from {ckpt} ({resumed['step'] + 1} {resumed['stage']} steps done)" if ckpt else ""))
        if r.prompts.skipped:
            print(f"skipped {r.prompts.skipped} training prompts longer than max_prompt_tokens={cfg.prompt_limit()}")
        if start.offline_rates and (resumed is None or resumed["stage"] == "sft"):
            print(f"stage 1: {start.offline_rates} offline pass rates from {cfg.filter.pass_rate_file}")

    if resumed is None or resumed["stage"] == "sft":  # a fresh run, or one resumed inside its SFT warm-up
        opt, start = sft_optimizer(r.model, cfg), 0
        if resumed is not None:
            read_checkpoint(ckpt, r.model, opt, cfg.dist_timeout_s)
            start, r.prompts.used = resumed["step"] + 1, resumed["used"]
            set_rng_state(resumed["rng"])  # last: nothing may draw between restoring it and the next step
        r.engine.sleep()
        if start < cfg.sft_steps:
            sft(r, opt, start)
        del opt
        r.engine.wake()
        r.engine.update_weights(policy_tensors(r.model), version=0)
        if cfg.eval_before_rl:
            r.held_out.before_rl = r.held_out.after_rl = run_eval(r.engine, r.tok, r.held_out, cfg, r.log, 0, r.t_start)
        r.opt = rl_optimizer(r.model, cfg)
        # the KL penalty's reference: a frozen copy of the policy as RL starts, kept only when used
        r.ref_model = reference_copy(r.model, cfg, meshes) if cfg.loss.kl_coef != 0 else None
        rl_start = 0
    else:  # resumed inside RL: optimizer, reference, data position, filter and predictor as checkpointed
        r.opt = rl_optimizer(r.model, cfg)
        read_checkpoint(ckpt, r.model, r.opt, cfg.dist_timeout_s)
        if resumed["ref_model"] is not None:
            r.ref_model = build_model(cfg, meshes, resumed["ref_model"]).requires_grad_(False)
        r.prompts.used, rl_start = resumed["used"], resumed["step"] + 1
        r.held_out.before_rl, r.held_out.after_rl = resumed["evals"]["after_sft"], resumed["evals"]["after_rl"]
        r.predictor.load_state_dict(resumed["predictor"])
        r.history.load_state_dict(resumed["history"])
        r.filter_rng.setstate(resumed["filter_rng"])
        set_rng_state(resumed["rng"])
        r.engine.update_weights(policy_tensors(r.model), version=rl_start)

    rl_loop(r, rl_start)
    if r.pool is not None:
        r.pool.close()
    if r.scorer_queue is not None:
        r.scorer_queue.close()
    r.log.close()
    save_model(r.model, r.tok, cfg, param_counts(cfg.model)["total"])
    return summarize(cfg, r.held_out, r.log.records, r.t_start)


def stopped(e: NonFiniteError | BlindScorerError, cfg: TrainConfig) -> str:
    """The one line a run stopped by a NaN or inf (no weight was stepped with it, no checkpoint written) or by a
    scorer that cannot see what it scores ends with."""
    newest = latest_checkpoint(cfg.out_dir)
    return f"stopped: {e}; " + (f"the newest checkpoint ({newest}) is the last good state" if newest
                                else "no checkpoint was written before it")


def main(cfg: TrainConfig) -> dict:
    """Run SFT then RL as configured (cfg as load_config built and checked it); returns the held-out
    accuracies before and after RL.

    Before any work every file the run reads is read and checked once (`prepare`; a problem is a
    ConfigError), the dry run's too; then rank 0 locks out_dir for this run (`lock_run_folder`,
    released when main returns or raises). Under torchrun (WORLD_SIZE > 1) every rank runs this: see
    setup_distributed. With cfg.resume it continues from a checkpoint of this run (checkpoint.py's
    choice 6) exactly where that run was (same weights, optimizer, data position, RNGs, filter
    history and length predictor), so a resumed run ends with the weights an uninterrupted one would
    have. A file the run cannot write (a full disk) is a WriteError naming it.
    """
    try:
        engine_builder(cfg.engine.name)  # the one setting only the registry knows
        start = prepare(cfg)
        if cfg.dry_run:  # the checks a run makes before its work, the resumed checkpoint's settings last
            resume_checkpoint(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.dry_run:
        print(json.dumps(dataclasses.asdict(cfg), default=str))
        from plan import print_plan
        return {"plan": print_plan(cfg, scorer=start.scorer_model)}
    if torch.device(cfg.device).type == "cuda":
        # before CUDA's first allocation, which reads it: segments that grow in place instead of new blocks, so the
        # rollout phase's and the training step's differently shaped tensors leave little fragmentation (plan.py's
        # reserve assumes it); a setting of the user's own wins
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    meshes = setup_distributed(cfg)
    if torch.device(cfg.device).type == "cuda":
        # beside bf16 compute, the fp32 matmuls left (the router's) use TF32 tensor cores; a float32 run stays exact
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.compute_dtype() != torch.float32
    finished, lock = False, None
    try:
        try:
            lock = lock_run_folder(cfg)
            # a collective under torchrun: rank 0 chooses, past any newer checkpoint that fails to load
            start.ckpt, start.resumed = resume_checkpoint(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        result = run(cfg, start, meshes)
        finished = True
        return result
    finally:
        if lock is not None:
            lock.release()
        import torch.distributed as dist
        # after a failure under torchrun the process exits at once (__main__): tearing the group down first could
        # wait on ranks that never answer
        if dist.is_initialized() and (finished or rank_world()[1] == 1):
            dist.destroy_process_group()


def abort(message: str | None):
    """End this rank of a failed multi-rank job now: the message (rank 0's, or a rank's own failure), any
    engine server it launched stopped, exit code 1, without the interpreter's teardown (atexit, NCCL), which
    can wait on ranks that died."""
    if message:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    stop_engine_servers()
    os._exit(1)


if __name__ == "__main__":
    try:
        config = parse_args(sys.argv[1:])  # every field's rule and the relations across sections, once
    except (ValueError, FileNotFoundError) as e:  # a config mistake: say what is wrong, without a traceback
        sys.exit(f"config error: {e}")
    several, rank0 = int(os.environ.get("WORLD_SIZE", "1")) > 1, os.environ.get("RANK", "0") == "0"
    try:
        main(config)
    except (ConfigError, NonFiniteError, BlindScorerError) as e:  # every rank finds these alike: one line, from rank 0
        # a NaN or inf, a blind scorer: the numbers went bad, not the code (where, and which state is good)
        line = f"config error: {e}" if isinstance(e, ConfigError) else stopped(e, config)
        abort(line if rank0 else None) if several else sys.exit(line)
    except WriteError as e:  # a full disk, a read-only folder: the machine's answer, one line from the rank that met it
        abort(f"write error: {e}") if several else sys.exit(f"write error: {e}")
    except Exception as e:  # a dead or stuck rank, or a bug: say so and exit rather than hang in teardown
        if not several:
            raise
        import traceback
        traceback.print_exc()
        abort(f"\n[rank {os.environ.get('RANK', '?')}] aborting the job: {type(e).__name__}: {e}\n(a collective "
              f"fails when another rank has died, or after dist_timeout_s={config.dist_timeout_s:g} s without it)")
