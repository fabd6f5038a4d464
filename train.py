"""Entry point: `python train.py configs/tiny.py [key=value ...]`.

One run = a short cold-start SFT warm-up on the task's own demonstrations (the seed paper,
arXiv 2512.07710, also starts RL from an SFT model), then the RL loop, each step:

    prompts -> [stage 1: skip prompts recently all-correct or all-wrong]
      -> length buckets -> engine.generate (G per prompt: tokens, logprobs, routes;
         [stage 2: k probes first, the other G - k only where the probes' rewards differ])
      -> reward ([workers score each generation batch while the next is generated];
         [shaping by penalties or a reward model, inside the correctness class])
      -> [more prompts while the batch lacks informative groups]
      -> stage 3: zero-variance groups dropped [or kept with RL-ZVP token advantages]
      -> group-relative advantages -> old logprobs + entropy (no grad, routes replayed)
      -> mini-batches of packed micro-batches: policy forward with the engine's routes
         replayed -> ESPO loss -> AdamW step -> weight sync to the engine

With `max_staleness` k > 0 the rollout half of each step (up to the advantages) runs on a
producer thread up to k steps ahead of the trainer, from weights at most k steps old
(`rl_loop_async`); the trainer recomputes pi_old, and TIS / IcePop can correct for the
engine's older policy. The trainer half (pi_old, the mini-batch policy update) is
trainer.py's `train_on_rollouts`.

Bracketed parts are off by default (see the filter and reward fields of TrainConfig);
with them off a run is bitwise identical to one without them.

with an eval on held-out prompts before RL, every `eval_every` steps and at the end: the
sampled accuracy (mean binary reward of `eval_samples` completions per prompt at the
rollout temperature, i.e. the RL objective on unseen prompts) and the greedy accuracy,
each with its standard error, and the RL gain with the paired SE (same prompts before
and after). Writes to out_dir: metrics.jsonl, model.safetensors + config.json,
tokenizer.tiktoken, plot.png, ckpt/step_N/ (and tensorboard/ with logger=tensorboard).

Several ranks: `torchrun --nproc_per_node=N train.py ... ep=E` shards the policy with FSDP2
over N ranks and its experts over E of them (distributed.py: setup_distributed, build_model). Rank r
generates generation batches r, r + N, ... with the seeds a 1-process run gives them, the
scored rollouts are all-gathered (so filter, advantages and history agree on every rank),
and rank r trains members r, r + N, ... of each mini-batch with the whole mini-batch's
normaliser: losses equal the 1-process run's to float rounding. Only rank 0 writes files.

Checkpoints (checkpoint.py: write_checkpoint / read_checkpoint): every ckpt_every optimizer steps, with
torch.distributed.checkpoint, atomically; `resume=auto` continues bit-exactly.

Config: `TrainConfig` (config.py) holds every default; a config file is plain assignments of
its fields (deltas only; `model = dict(...)` for ModelConfig fields); `key=value` on the
command line overrides either (`model.dim=128`), typed by the field.

Legend: B sequences, T tokens, P prompts, G rollouts per prompt, L MoE layers, K experts per token.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from config import TrainConfig, load_config, parse_args  # noqa: F401  train.load_config, as callers use it
from checkpoint import read_checkpoint, resume_path, rng_state, save_checkpoint, set_rng_state, write_checkpoint
from distributed import (all_gather_list, all_reduce_float, build_model, full_policy_tensors, rank_world,
                         reference_copy, setup_distributed)
from espo import group_advantages
from filter import PromptHistory, Scored, StageConfig, collect_groups, post_rollout_filter
from metrics import MetricsLog, plot
from model import Transformer, token_logprobs  # noqa: F401  train.Transformer, as callers use it
from reward import (RewardPool, StubRewardModel, TaskMix, adjust_rewards, demonstration, overlong_penalty,
                    repetition_penalty, rm_score)
from rollout import NativeEngine, policy_tensors
from scheduler import LengthPredictor, Pipeline, length_buckets
from tokenizer import EOS, PAD, encode_prompt, load_tokenizer, save_tokenizer, train_tokenizer
from trainer import TrainBatch, lr_at, optimizer_step, sequence_batch, train_on_rollouts

STREAM_SEED_STRIDE = 1_000_000_000  # seed offset between a step's generate rounds; stream 0 keeps the old seeds
ROLLOUT_TIMEOUT_S = 3600.0  # async loop: a producer silent this long is taken as hung
RM_SCORE_SCALE = 1.0  # reward-model score units per tanh unit in the shaping score (the stub's scores lie in [-1, 1])


# ----------------------------------------------------------------------------- stages

def sft_optimizer(model, cfg: TrainConfig):
    """The SFT warm-up's AdamW (its own: the RL optimizer starts fresh after SFT)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def sft(model, tok, task: TaskMix, order: list[int], cfg: TrainConfig, log, *, opt=None, start: int = 0, used: int = 0,
        after_step=None) -> int:
    """Cold-start SFT on demonstrations, steps start..sft_steps-1; returns how many items of `order` it consumed.

    Multi-rank: rank r trains rows r, r + world, ... of each batch, its loss divided by the
    whole batch's token count (times world: FSDP averages gradients), so the step equals
    the 1-process step. after_step(step, used, opt) runs after each optimizer step (checkpoints).
    """
    opt = opt or sft_optimizer(model, cfg)
    eos, pad = tok.encode_single_token(EOS), tok.encode_single_token(PAD)
    rank, world = rank_world()
    if cfg.sft_batch_size < world:
        raise ValueError(f"sft_batch_size={cfg.sft_batch_size} must be >= the world size {world}")
    bar = tqdm(range(start, cfg.sft_steps), desc="sft", dynamic_ncols=True, initial=start, total=cfg.sft_steps,
               disable=rank != 0)
    for step in bar:
        items = [task[order[(used + i) % len(order)]] for i in range(cfg.sft_batch_size)]
        used += cfg.sft_batch_size
        prompts = [encode_prompt(tok, it.question) for it in items]
        seqs = [p + tok.encode_ordinary(demonstration(it)) + [eos] for p, it in zip(prompts, items)]
        if world > 1:
            num_tokens = sum(len(s) - len(p) for s, p in zip(seqs, prompts))  # the whole batch's loss tokens
            seqs, prompts = seqs[rank::world], prompts[rank::world]
        inputs, targets, mask, _ = sequence_batch(seqs, [len(p) for p in prompts], pad)
        logits, _ = model(inputs.to(cfg.device))
        nll = -token_logprobs(logits, targets.to(cfg.device))
        mask = mask.to(cfg.device)
        if world > 1:
            loss = (nll * mask).sum() / num_tokens
            (loss * world).backward()
            loss_value = all_reduce_float(loss.item())
        else:
            loss = (nll * mask).sum() / mask.sum()
            loss.backward()
            loss_value = loss.item()
        lr = lr_at(step, cfg.sft_lr, cfg.lr_warmup_steps, cfg.sft_steps, cosine=True)
        optimizer_step(model, opt, cfg, lr)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        log({"stage": "sft", "step": step, "loss": loss_value, "lr": lr})
        if after_step is not None:
            after_step(step, used, opt)
    return used


def generate_rollouts(engine: NativeEngine, prompts: list[list[int]], predicted: list[float], cfg: TrainConfig, seed: int,
                      *, n: int | None = None, stream: int = 0, on_rollouts=None):
    """Rollouts of every prompt, n each (default G), generated in batches of similar predicted length.

    stream: which of a step's generate rounds this is (probes, the rest, over-sampling),
    so each draws its own random numbers. on_rollouts(batch) sees each batch as it is
    generated (to start scoring it while the next one is generated).
    Multi-rank: rank r generates only batches r, r + world, ... (so only their rollouts are
    returned), each with the prompts and seed it has in a 1-process run: the same rollouts.
    """
    n = cfg.group_size if n is None else n
    per_batch = max(1, cfg.gen_batch_rows // n)
    rollouts = []
    rank, world = rank_world()
    for b, bucket in enumerate(length_buckets(predicted, per_batch)):
        if b % world != rank:
            continue
        batch = engine.generate([prompts[i] for i in bucket], n=n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, seed=seed * 1000 + b + stream * STREAM_SEED_STRIDE, group_ids=bucket)
        if on_rollouts is not None:
            on_rollouts(batch)
        rollouts += batch
    rollouts.sort(key=lambda r: r.group_id)  # stable: keeps each group's sample order
    return rollouts


def predict_length(predictor: LengthPredictor, item, prompt_len: int) -> float:
    """Predicted completion tokens of a prompt: its own history, else its task's at this prompt length."""
    return predictor.predict(item.question, task=item.task, prompt_len=prompt_len)


def sample_groups(engine, tok, task, items, n: int, predictor, cfg: TrainConfig, step: int, stream: int, pool):
    """n scored rollouts of each item (filter.Scored, payload = the Rollout) and the scoring reasons.

    With a RewardPool each generation batch is scored while the next one is generated.
    """
    prompts = [encode_prompt(tok, it.question) for it in items]
    predicted = [len(p) + predict_length(predictor, it, len(p)) for p, it in zip(prompts, items)]
    submit = None
    if pool is not None:
        def submit(batch):  # rollouts of a prompt come out in order, so (group, j) names each one
            for j, r in enumerate(batch):
                pool.submit((stream, r.group_id, j % n), completion_text(tok, r), items[r.group_id])
    rollouts = generate_rollouts(engine, prompts, predicted, cfg, seed=cfg.seed + step, n=n, stream=stream, on_rollouts=submit)
    if pool is not None:
        mine = sorted({r.group_id for r in rollouts})
        rewards, reasons = pool.gather([(stream, i, j) for i in mine for j in range(n)])
    else:
        rewards, reasons = [task.score(completion_text(tok, r), items[r.group_id]) for r in rollouts], []
    if rank_world()[1] > 1:  # every rank gets every scored rollout: the filter, advantages and history stay in step
        gathered = all_gather_list([(r, w) for r, w in zip(rollouts, rewards)])
        gathered.sort(key=lambda rw: rw[0].group_id)  # stable: a group is generated whole on one rank
        rollouts, rewards = [r for r, _ in gathered], [w for _, w in gathered]
        reasons = all_gather_list(list(reasons))
    scored = [Scored(w, len(r.completion_ids), r) for w, r in zip(rewards, rollouts)]
    return [scored[i * n:(i + 1) * n] for i in range(len(items))], reasons


def completion_text(tok, r) -> str:
    ids = r.completion_ids[:-1] if r.finish_reason == "stop" else r.completion_ids
    return tok.decode(ids)


@torch.no_grad()
def evaluate(engine: NativeEngine, tok, task: TaskMix, items, cfg: TrainConfig, *, samples: int,
             temperature: float) -> torch.Tensor:
    """Per held-out item, the mean binary reward of `samples` completions at `temperature`, [n] fp32.

    temperature 0 is greedy (use samples=1). Sampling is seeded by cfg.seed, so every
    eval of a run draws from the same random stream.
    """
    scores = []
    rows = max(1, cfg.eval_batch_rows // samples)
    rank, world = rank_world()
    for c, i in enumerate(range(0, len(items), rows)):
        if c % world != rank:  # multi-rank: rank r takes chunks r, r + world, ...: the 1-process chunks and seeds
            continue
        chunk = items[i:i + rows]
        outs = engine.generate([encode_prompt(tok, it.question) for it in chunk], n=samples, seed=cfg.seed + i,
                               max_new_tokens=cfg.max_new_tokens, temperature=temperature, top_p=cfg.top_p)
        scores.append((i, [task.score(completion_text(tok, r), chunk[r.group_id]) for r in outs]))
    scores = [x for _, part in sorted(all_gather_list(scores)) for x in part]
    return torch.tensor(scores).view(len(items), samples).mean(dim=1)


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error std/sqrt(n) (population std: sqrt(p(1-p)/n) for 0/1 data)."""
    return x.mean().item(), (x.var(correction=0) / len(x)).sqrt().item()


@dataclass
class RLState:
    """What the RL loop carries from step to step besides the model: prompt history, scorers, RNG."""
    history: PromptHistory = field(default_factory=PromptHistory)
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # stage 1 only; apart from torch's RNG
    pool: RewardPool | None = None
    reward_model: object = None  # reward.RewardModel


def stage_config(cfg: TrainConfig) -> StageConfig:
    return StageConfig(group_size=cfg.group_size, skip_prob=cfg.skip_prob, skip_half_life=cfg.skip_half_life,
                       probe_size=cfg.probe_size, stop_threshold=cfg.probe_stop_threshold,
                       enlarged_group_size=cfg.enlarged_group_size,
                       oversample_rounds=cfg.oversample_rounds, keep_zero_variance=cfg.zero_variance == "rl-zvp")


def final_rewards(groups, correct: list[torch.Tensor], cfg: TrainConfig, rm, tok) -> list[torch.Tensor]:
    """Per group, the correctness plus shaping (penalties, reward model) kept inside the correctness class."""
    if not (cfg.overlong_buffer or cfg.repetition_weight or rm is not None):
        return correct
    out = []
    for (item, group), c in zip(groups, correct):
        ids = [s.payload.completion_ids for s in group]
        s_G = torch.zeros(len(group), dtype=torch.float64)
        if cfg.overlong_buffer:
            s_G += torch.tensor([overlong_penalty(len(x), max_len=cfg.max_new_tokens, buffer=cfg.overlong_buffer) for x in ids])
        if cfg.repetition_weight:
            s_G += cfg.repetition_weight * torch.tensor([repetition_penalty(x) for x in ids])
        if rm is not None:
            texts = [completion_text(tok, s.payload) for s in group]
            scores = torch.tensor(rm.score([item.question] * len(group), texts), dtype=torch.float64)
            s_G += cfg.rm_weight * rm_score(scores, scale=RM_SCORE_SCALE)
        out.append(adjust_rewards(c, s_G, margin=cfg.shaping_margin))
    return out


def group_advantages_ragged(rewards: list[torch.Tensor], cfg: TrainConfig) -> list[torch.Tensor]:
    """group_advantages of groups that may differ in size: one batched call per size."""
    adv = [None] * len(rewards)
    for size in sorted({len(r) for r in rewards}):
        idx = [i for i, r in enumerate(rewards) if len(r) == size]
        for i, a in zip(idx, group_advantages(torch.stack([rewards[i] for i in idx]), scale_by_std=cfg.adv_scale_by_std,
                                                         std_over=cfg.adv_std_over)):
            adv[i] = a
    return adv


def collect_rollouts(engine, tok, task, items, predictor, cfg: TrainConfig, step: int, state: RLState, draw=None):
    """The rollout half of an RL step over `items` (prompts): stages 1-2 of the filter while generating
    and scoring (with over-sampling from draw(n) if configured), stage 3 and advantages.

    Touches the engine, predictor and `state`, never the trainer's model, so in the async loop it
    runs on the producer thread. Returns (metrics, batch, zvp): batch is None when every group was
    dropped; zvp maps a batch index to its correctness for RL-ZVP sequences (token advantages are
    made by the trainer, from its own old entropy).
    """
    t0 = time.perf_counter()
    streams, reasons = itertools.count(), Counter()

    def sample(batch_items, n):  # each call is a generate round of its own: probes, the rest, over-sampling
        groups, why = sample_groups(engine, tok, task, batch_items, n, predictor, cfg, step, next(streams), state.pool)
        reasons.update(why)
        return groups

    def predicted_tokens(it):
        return predict_length(predictor, it, len(encode_prompt(tok, it.question)))

    groups, counts = collect_groups(items, sample, state.history, step, stage_config(cfg), key=lambda it: it.question,
                                    predicted_tokens=predicted_tokens, rng=state.rng, draw=draw, target=len(items))
    t_gen = time.perf_counter() - t0
    rollouts = [s.payload for _, g in groups for s in g]
    for (item, g) in groups:
        for s in g:
            predictor.observe(item.question, s.num_tokens, task=item.task, prompt_len=len(s.payload.prompt_ids))
    correct = [torch.tensor([s.reward for s in g]) for _, g in groups]
    lengths = [torch.tensor([s.num_tokens for s in g]) for _, g in groups]
    rewards = final_rewards(groups, correct, cfg, state.reward_model, tok)
    keep_P, fstats = post_rollout_filter(rewards, lengths, correct)
    zero_var_P = ~keep_P
    if cfg.zero_variance == "rl-zvp":  # nothing is dropped: zero-variance groups are reshaped instead
        keep_P = torch.ones_like(keep_P)
        fstats.update(zvp_groups=fstats["groups_dropped"], groups_dropped=0, rollouts_dropped=0, tokens_dropped=0)
    adv = torch.cat(group_advantages_ragged(rewards, cfg))  # rollouts are group-major, so this lines up with them
    group_of = [p for p, (_, g) in enumerate(groups) for _ in g]
    correct_flat = torch.cat(correct)
    m = {"stage": "rl", "step": step, "reward": correct_flat.mean().item(), "completion_len": torch.cat(lengths).float().mean().item(),
         "stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / len(rollouts), "t_generate": t_gen,
         **{f"filter/{k}": v for k, v in fstats.items()}, **{f"filter/{k}": v for k, v in counts.items()},
         "filter/rollouts_generated": len(rollouts), "filter/tokens_generated": int(torch.cat(lengths).sum()),
         "reward/timeouts": reasons["timeout"], "reward/errors": sum(v for k, v in reasons.items() if k.startswith("error"))}
    versions = [r.weight_version for r in rollouts]
    m["weight_version_min"], m["weight_version_max"] = min(versions), max(versions)
    kept = [i for i in range(len(rollouts)) if keep_P[group_of[i]]]
    if not kept:
        return m, None, {}
    batch = TrainBatch(seqs=[rollouts[i].prompt_ids + rollouts[i].completion_ids for i in kept],
                       starts=[len(rollouts[i].prompt_ids) for i in kept],
                       routes=[rollouts[i].routes for i in kept], adv_B=adv[kept],
                       infer_logp=[rollouts[i].logprobs for i in kept])
    zvp = {j: bool(correct_flat[i] > 0) for j, i in enumerate(kept) if zero_var_P[group_of[i]]}
    return m, batch, zvp


def rl_step(model, opt, engine, tok, task, items, predictor, cfg: TrainConfig, step: int, state: RLState | None = None,
            draw=None, ref_model=None) -> dict:
    """One synchronous RL step over `items` (prompts): collect_rollouts, train_on_rollouts, weight sync.
    Returns metrics. ref_model: the frozen reference policy of the KL penalty (needed when cfg.kl_coef != 0)."""
    m, batch, zvp = collect_rollouts(engine, tok, task, items, predictor, cfg, step, state or RLState(), draw)
    if batch is None:
        m["skipped_update"] = 1
        return m
    t1 = time.perf_counter()
    m.update(train_on_rollouts(model, opt, batch, zvp, cfg, step, tok.encode_single_token(PAD), ref_model=ref_model))
    engine.update_weights(full_policy_tensors(model), version=step + 1)
    m["t_train"] = time.perf_counter() - t1
    m["trained_sequences"] = len(batch.seqs)
    return m


# ----------------------------------------------------------------------------- the async loop

def rl_loop_async(model, opt, engine, tok, task, draw, predictor, cfg: TrainConfig, state: RLState, ref_model=None,
                  start: int = 0, sync_after: Callable[[int], bool] | None = None):
    """RL steps start..cfg.rl_steps - 1 with rollouts generated up to cfg.max_staleness weight versions
    ahead; yields each step's metrics. One process only (main refuses several ranks).

    A producer thread (scheduler.Pipeline) runs collect_rollouts for step s+1..s+k on its own
    engine copy while the trainer runs train_on_rollouts for step s. After each step the
    trainer publishes a snapshot of its weights as version s + 1; the producer loads the
    newest one between steps and never starts step s with a version older than s - k, so
    every rollout of step s has weight version in [s - k, s] (its staleness, logged as
    `async/staleness_max`, is at most k). `engine` (the caller's, used for eval) is kept in
    sync with the trainer on the trainer thread. The prompts of each step are drawn by the
    producer in step order, so they are the same as in the synchronous loop; the numbers
    are not, since rollouts come from older weights.

    Checkpoints: after a step s with sync_after(s) true the producer has drawn and generated
    nothing of step s + 1 (scheduler.Pipeline's sync_before), and the new weights are published
    only when the caller asks for the next step, so a checkpoint written between the two
    holds a state no rollout has run ahead of (data position, filter history, length
    predictor, RNG). Resuming from it continues the run validly, not bitwise: which weight
    version each step's rollouts get depends on thread timing.

    Thread counts (OpenMP teams are per thread): the producer uses cfg.rollout_threads and the
    trainer cfg.trainer_threads torch CPU threads. 0 on a CPU device = split torch's count
    between the two, since two full teams on the same cores spin against each other (a 2-core
    test ran 7x slower oversubscribed); 0 on a GPU = torch's default.
    Raises whatever the producer raised, or TimeoutError if no batch arrives in ROLLOUT_TIMEOUT_S.
    """
    pad_id = tok.encode_single_token(PAD)
    producer_engine = copy.deepcopy(engine)

    def produce(step):
        if rollout_threads:
            torch.set_num_threads(rollout_threads)  # the producer thread's own OpenMP team
        t = time.perf_counter()
        out = collect_rollouts(producer_engine, tok, task, draw(cfg.prompts_per_step), predictor, cfg, step, state, draw)
        out[0]["t_rollout"] = time.perf_counter() - t
        return out

    def apply(weights, version):
        producer_engine.update_weights(weights.items(), version=version)

    threads = torch.get_num_threads()
    rollout_threads, trainer_threads = cfg.rollout_threads, cfg.trainer_threads
    if torch.device(cfg.device).type == "cpu":
        rollout_threads = rollout_threads or max(1, threads // 2)
        trainer_threads = trainer_threads or max(1, threads - rollout_threads)
    if trainer_threads:
        torch.set_num_threads(trainer_threads)
    sync_after = sync_after or (lambda step: False)
    pipe = Pipeline(produce, apply, steps=cfg.rl_steps, max_staleness=cfg.max_staleness,
                    start_step=start, start_version=engine.weight_version, timeout=ROLLOUT_TIMEOUT_S,
                    sync_before=lambda step: sync_after(step - 1))
    try:
        for step in range(start, cfg.rl_steps):
            t0 = time.perf_counter()
            m, batch, zvp = pipe.next()
            t1 = time.perf_counter()
            m["async/wait"] = t1 - t0  # trainer idle, waiting for rollouts
            m["async/staleness_max"] = step - m["weight_version_min"]
            m["async/staleness_min"] = step - m["weight_version_max"]
            if batch is None:
                m["skipped_update"] = 1
            else:
                m.update(train_on_rollouts(model, opt, batch, zvp, cfg, step, pad_id, ref_model=ref_model))
                m["trained_sequences"] = len(batch.seqs)
            engine.update_weights(policy_tensors(model), version=step + 1)
            m["t_train"] = time.perf_counter() - t1
            yield m  # the caller logs, evaluates and checkpoints before the producer sees these weights
            # a snapshot, so the trainer's next steps cannot change weights the producer is loading
            pipe.publish({n: t.clone() for n, t in policy_tensors(model)}, version=step + 1)
    finally:
        pipe.close()
        torch.set_num_threads(threads)


def check_config(cfg: TrainConfig):
    """Refuse settings that cannot run, before any work (tokenizer, SFT). Raises ValueError naming
    the value and what would be valid."""
    if cfg.zero_variance not in ("drop", "rl-zvp") or cfg.reward_model not in ("", "stub"):
        raise ValueError(f"zero_variance={cfg.zero_variance!r} (valid: 'drop', 'rl-zvp'), "
                         f"reward_model={cfg.reward_model!r} (valid: '', 'stub')")
    if not 0 <= cfg.shaping_margin < 0.5 or not 0 <= cfg.overlong_buffer <= cfg.max_new_tokens:
        raise ValueError(f"need 0 <= shaping_margin < 0.5 and 0 <= overlong_buffer <= max_new_tokens; "
                         f"got {cfg.shaping_margin}, {cfg.overlong_buffer}")
    stage_config(cfg)  # raises on bad filter settings now, not after the SFT warm-up
    if cfg.max_staleness < 0 or cfg.rollout_threads < 0 or cfg.trainer_threads < 0:
        raise ValueError(f"max_staleness={cfg.max_staleness}, rollout_threads={cfg.rollout_threads}, "
                         f"trainer_threads={cfg.trainer_threads}: each must be >= 0")
    if cfg.max_staleness and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # the producer thread would need its own process group for the collectives of its rollouts
        raise ValueError(f"max_staleness={cfg.max_staleness} runs in one process for now "
                         f"(WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}): use max_staleness=0 with several ranks")
    if cfg.eval_seed - cfg.train_seed <= cfg.train_size:
        raise ValueError(f"eval_seed={cfg.eval_seed} overlaps the training items: it must exceed "
                         f"train_seed + train_size = {cfg.train_seed + cfg.train_size}")
    if cfg.ckpt_every < 0 or cfg.ckpt_keep < 1 or cfg.dist_timeout_s <= 0 or cfg.logger not in ("none", "tensorboard", "wandb"):
        raise ValueError(f"need ckpt_every >= 0, ckpt_keep >= 1, dist_timeout_s > 0 and logger in 'none', 'tensorboard', "
                         f"'wandb'; got {cfg.ckpt_every}, {cfg.ckpt_keep}, {cfg.dist_timeout_s}, {cfg.logger!r}")


def main(cfg: TrainConfig) -> dict:
    """Run SFT then RL as configured; returns the held-out accuracies before and after RL.

    Under torchrun (WORLD_SIZE > 1) every rank runs this: see setup_distributed. With
    cfg.resume it continues from a checkpoint exactly where that run was (same weights,
    optimizer, data position, RNGs, filter history and length predictor), so a resumed run
    ends with the weights an uninterrupted one would have.
    """
    if cfg.dry_run:
        print(json.dumps(dataclasses.asdict(cfg), default=str))
        from plan import print_plan
        rows = print_plan(cfg.model, gpus_per_node=cfg.gpus_per_node, ep=cfg.ep, microbatch_tokens=cfg.microbatch_tokens,
                          activation_checkpoint=cfg.activation_checkpoint)
        return {"plan": rows}
    check_config(cfg)
    dims = setup_distributed(cfg)
    try:
        return run(cfg, dims)
    finally:
        if dims is not None:
            import torch.distributed as dist
            dist.destroy_process_group()


def run(cfg: TrainConfig, dims=None) -> dict:
    """main's body once the config is checked and the process group (if any) is up."""
    rank, world = rank_world()
    if rank == 0:
        print(json.dumps(dataclasses.asdict(cfg), default=str))  # the resolved config
    t_start = time.perf_counter()
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    ckpt = resume_path(cfg)
    resumed = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False) if ckpt else None
    if ckpt:
        with open(os.path.join(ckpt, "config.json")) as f:
            saved = json.load(f)
        if saved["model"] != json.loads(json.dumps(dataclasses.asdict(cfg.model))):
            raise ValueError(f"resume: {ckpt} holds a model of another shape: {saved['model']}")
    task = TaskMix(cfg.tasks, seed=cfg.train_seed, size=cfg.train_size)
    if cfg.init_from:  # start from an earlier run's weights and tokenizer (e.g. its SFT warm-up)
        tok = load_tokenizer(os.path.join(cfg.init_from, "tokenizer.tiktoken"), cfg.model.vocab_size)
    else:
        tok = train_tokenizer([it.question + "\n" + demonstration(it) for it in task.items],
                              vocab_size=cfg.model.vocab_size, num_merges=cfg.bpe_merges)
    if rank == 0:
        save_tokenizer(tok, os.path.join(cfg.out_dir, "tokenizer.tiktoken"))
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            f.write(json.dumps(dataclasses.asdict(cfg), default=str, indent=1))
    held_out = TaskMix(cfg.tasks, seed=cfg.eval_seed, size=4 * cfg.eval_size)
    eval_items = held_out.exclude({it.question for it in task.items})[:cfg.eval_size]
    if len(eval_items) < cfg.eval_size:
        raise ValueError(f"only {len(eval_items)} held-out prompts are unseen in training; need eval_size={cfg.eval_size}")

    init_state = None
    if cfg.init_from:
        from safetensors.torch import load_file
        init_state = load_file(os.path.join(cfg.init_from, "model.safetensors"))
    model = build_model(cfg, dims, init_state)
    engine = NativeEngine(cfg.model, eos_id=tok.encode_single_token(EOS), pad_id=tok.encode_single_token(PAD), device=cfg.device)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model: {n_params / 1e6:.2f}M params; {len(task)} train prompts, {len(eval_items)} held-out prompts"
              + (f"; {world} ranks (ep={cfg.ep})" if world > 1 else "")
              + (f"; resuming from {ckpt} ({resumed['step'] + 1} {resumed['phase']} steps done)" if ckpt else ""))
    log = MetricsLog(cfg, keep=resumed["num_records"] if resumed else None)
    order = torch.randperm(len(task), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    predictor = LengthPredictor(prior=cfg.max_new_tokens / 2)
    state = RLState(rng=random.Random(cfg.seed), reward_model=StubRewardModel() if cfg.reward_model == "stub" else None,
                    pool=RewardPool(task.score, workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s)
                    if cfg.reward_workers else None)
    evals = {}

    def run_eval(step):
        """Sampled (mean of eval_samples at the rollout temperature) and greedy accuracy per held-out prompt."""
        sampled = evaluate(engine, tok, held_out, eval_items, cfg, samples=cfg.eval_samples, temperature=cfg.temperature)
        greedy = evaluate(engine, tok, held_out, eval_items, cfg, samples=1, temperature=0.0)
        (acc, se), (g_acc, g_se) = mean_se(sampled), mean_se(greedy)
        log({"stage": "eval", "step": step, "eval_acc": acc, "eval_se": se, "eval_greedy_acc": g_acc,
             "eval_greedy_se": g_se, "time": time.perf_counter() - t_start})
        if rank == 0:
            tqdm.write(f"step {step}: eval accuracy {acc:.3f} +- {se:.3f} sampled, {g_acc:.3f} +- {g_se:.3f} greedy")
        return sampled, greedy

    def checkpoint(position: int, opt, phase: str, step: int, used: int, ref_model=None):
        """Write a checkpoint after `step` of `phase` if `position` (optimizer steps so far) is due."""
        if not cfg.ckpt_every or position % cfg.ckpt_every:
            return
        trainer_state = {"phase": phase, "step": step, "position": position, "used": used, "rng": rng_state(),
                         "filter_rng": state.rng.getstate(), "history": state.history.state_dict(),
                         "predictor": predictor.state_dict(), "num_records": len(log.records), "evals": dict(evals),
                         "ref_model": dict(full_policy_tensors(ref_model)) if ref_model is not None else None}
        write_checkpoint(cfg.out_dir, position, model, opt, trainer_state, cfg)

    if resumed is None or resumed["phase"] == "sft":
        sft_opt, start, used = sft_optimizer(model, cfg), 0, 0
        if resumed is not None:
            read_checkpoint(ckpt, model, sft_opt)
            start, used = resumed["step"] + 1, resumed["used"]
            set_rng_state(resumed["rng"])
        if cfg.sft_steps:
            used = sft(model, tok, task, order, cfg, log, opt=sft_opt, start=start, used=used,
                       after_step=lambda step, used, opt: checkpoint(step + 1, opt, "sft", step, used))
        del sft_opt
        engine.update_weights(full_policy_tensors(model), version=0)
        evals["after_sft"] = evals["after_rl"] = run_eval(0)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        # the KL penalty's reference: a frozen copy of the policy as RL starts, kept only when used
        ref_model = reference_copy(model, cfg, dims) if cfg.kl_coef != 0 else None
        rl_start = 0
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        read_checkpoint(ckpt, model, opt)
        ref_model = None
        if resumed["ref_model"] is not None:
            ref_model = build_model(cfg, dims, resumed["ref_model"]).requires_grad_(False)
        used, rl_start, evals = resumed["used"], resumed["step"] + 1, dict(resumed["evals"])
        predictor.load_state_dict(resumed["predictor"])
        state.history.load_state_dict(resumed["history"])
        state.rng.setstate(resumed["filter_rng"])
        set_rng_state(resumed["rng"])
        engine.update_weights(full_policy_tensors(model), version=rl_start)
    if cfg.pass_rate_file and resumed is None:
        n = state.history.load_offline(cfg.pass_rate_file)
        if rank == 0:
            print(f"stage 1: {n} offline pass rates from {cfg.pass_rate_file}")

    def draw(n: int) -> list:
        """The next n training prompts (the step's own, then any over-sampling)."""
        nonlocal used
        out = [task[order[(used + i) % len(order)]] for i in range(n)]
        used += n
        return out

    bar = tqdm(range(rl_start, cfg.rl_steps), desc="rl", dynamic_ncols=True, initial=rl_start, total=cfg.rl_steps,
               disable=rank != 0)
    def due(step: int) -> bool:  # a checkpoint follows this RL step
        return bool(cfg.ckpt_every) and (cfg.sft_steps + step + 1) % cfg.ckpt_every == 0

    steps = (rl_loop_async(model, opt, engine, tok, task, draw, predictor, cfg, state, ref_model, start=rl_start,
                           sync_after=due) if cfg.max_staleness else None)
    for step in bar:
        if steps is not None:
            m = next(steps)
        else:
            m = rl_step(model, opt, engine, tok, task, draw(cfg.prompts_per_step), predictor, cfg, step, state, draw, ref_model=ref_model)
        m["time"] = time.perf_counter() - t_start
        log(m)
        bar.set_postfix(reward=f"{m['reward']:.2f}", zv=f"{m['filter/zero_variance_frac']:.2f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.rl_steps:
            evals["after_rl"] = run_eval(step + 1)
        checkpoint(cfg.sft_steps + step + 1, opt, "rl", step, used, ref_model)  # async: its producer waits (due)
    if steps is not None:
        steps.close()
    if state.pool is not None:
        state.pool.close()
    log.close()
    save_checkpoint(model, cfg, cfg.out_dir)
    after_sft, after_rl = evals["after_sft"], evals["after_rl"]
    summary = {}
    if rank == 0:
        plot(log.records, os.path.join(cfg.out_dir, "plot.png"))
        print(f"{f'held-out accuracy (n={len(eval_items)} prompts)':<38}{'after SFT':<17}{'after RL':<17}RL gain")
    for k, name in enumerate([f"sampled (mean of {cfg.eval_samples}, T={cfg.temperature})", "greedy"]):
        (a0, s0), (a1, s1) = mean_se(after_sft[k]), mean_se(after_rl[k])
        gain, paired_se = mean_se(after_rl[k] - after_sft[k])  # same prompts before and after: a paired difference
        if rank == 0:
            print(f"{name:<38}{a0:.3f} +- {s0:.3f}   {a1:.3f} +- {s1:.3f}   {gain:+.3f} = {gain / max(paired_se, 1e-9):.1f} "
                  f"paired SE ({gain / max(math.hypot(s0, s1), 1e-9):.1f} unpaired)")
        summary[["sampled", "greedy"][k]] = {"sft_acc": a0, "sft_se": s0, "rl_acc": a1, "rl_se": s1,
                                             "gain": gain, "gain_paired_se": paired_se}
    if rank == 0:
        print(f"wrote {cfg.out_dir}/: metrics.jsonl, model.safetensors, config.json, tokenizer.tiktoken, plot.png"
              f"{', ckpt/' if os.path.isdir(os.path.join(cfg.out_dir, 'ckpt')) else ''} "
              f"in {time.perf_counter() - t_start:.0f}s")
    return summary


if __name__ == "__main__":
    try:
        config = parse_args(sys.argv[1:])
        if not config.dry_run:
            check_config(config)
    except (ValueError, FileNotFoundError) as e:  # a config mistake: say what is wrong, without a traceback
        sys.exit(f"config error: {e}")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        main(config)
    else:
        try:
            main(config)
        except Exception as e:  # noqa: BLE001  a dead or stuck rank: say so and exit rather than hang in teardown
            import traceback
            traceback.print_exc()
            sys.stderr.write(f"\n[rank {os.environ.get('RANK', '?')}] aborting the job: {type(e).__name__}: {e}\n"
                             f"(a collective fails when another rank has died, or after dist_timeout_s="
                             f"{config.dist_timeout_s:g} s without it)\n")
            sys.stderr.flush()
            os._exit(1)
