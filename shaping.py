"""The RL step's reward shaping by a reward model or a generative judge (reward.model): `shape_rewards`, each
group's rewards moved inside its correctness class by the scorer's outputs and checked against inversion;
`judge_generator`, the native engine a judge generates on; and `ScorerQueue`, the scorer at work while the
policy still generates. train.collect_rollouts calls the first when reward.shapes; train.start_run builds the
scorer with the second (reward_model.reward_model_for) and, with reward workers, the queue. What they read is
named in their signatures (the reward section, the tokenizer, the scorer and its queue), not a train.Run.

Notable choices:
1. Under torchrun each rank's whole scorer scores the groups it generated (reward_model.py's choice 8) and
   every rank learns every group's scores (all_gather_list), so all ranks shape alike.
2. Every group is checked, every step, to keep each correct response's reward above each wrong one's
   (reward.adjust_rewards' guarantee, arXiv 2512.07710's adjustment against advantage inversion): a broken
   guarantee stops the run naming the step and group, before a step trains on it.
3. With reward.workers > 0 (the reward pool: verifiers score while generation goes on) the scorer does too: each
   generate call's groups go to `ScorerQueue`, one worker thread scoring a group at a time, in submission
   order, exactly as shape_rewards would (reward.scorer_outputs of the group), and shape_rewards waits only
   for what is left. A group whose probes and rest come from two calls (filter.probe_size) is scored as two
   parts, which can differ from scoring it whole by float rounding (the reward model's batches). The worker
   runs no collective (each rank's scorer is its own), so it never meets the ranks' lockstep. Where the
   device is one GPU the scorer's kernels queue behind the engine's; what overlaps is the host's work.
4. A sharded reward model (reward.rm_shard, reward_model.py's choice 9) scores collectively: each rank's own
   rows in one call per step, inline (never on the queue's thread, whose forwards would meet the main
   thread's collectives), every rank calling it, with no rows of its own too.
5. A scorer that cannot see what it scores is loud: a step in which more than UNUSABLE_SHARE of its outputs are
   unusable (a reward model's unscored pairs, rm/unscored; a judge's prompts too long for it or replies with no
   verdict, judge/too_long and judge/unparsed) warns, and UNUSABLE_STEPS such steps in a row stop the run
   (`UnusableStreak`): its shaping would be zero, and with reward.rm_only the reward identically 0. The counts are
   every rank's, so every rank stops alike.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from distributed import all_gather_list
from reward import PairwiseJudge, RewardConfig, Scorer, order_violations, scorer_outputs, shaped_rewards
from rollout import NativeEngine
from sampler import Rollout, SamplingParams
from weights import policy_tensors

if TYPE_CHECKING:
    from config import TrainConfig
    from data import Item
    from filter import Scored
    from tokenizer import Tokenizer

JUDGE_SEED = 0  # a generative judge decodes greedily; a fixed seed keeps its calls off torch's RNG (the policy's)
UNUSABLE_SHARE = 0.5  # past this share of a step's scorer outputs unusable, the step's shaping is mostly zero: warn
UNUSABLE_STEPS = 3  # so many such steps in a row stop the run: one is a bad batch, three a scorer that cannot see


def scores_collectively(scorer: Scorer | None) -> bool:
    """Whether scorer is a sharded reward model (reward.rm_shard): scored in one collective call per rank and step
    (choice 4), never on a ScorerQueue's thread."""
    return scorer is not None and not isinstance(scorer, PairwiseJudge) and scorer.sharded


def shape_rewards(groups: list[tuple[Item, list[Scored]]], correct: list[torch.Tensor], step: int, *,
                  cfg: RewardConfig, max_new_tokens: int, tok: Tokenizer, scorer: Scorer | None,
                  queue: ScorerQueue | None) -> tuple[list[torch.Tensor], dict]:
    """groups: the step's (item, [Scored]) pairs; cfg: the run's reward section; max_new_tokens: the generation
    limit (sampling.max_new_tokens, where the overlong penalty ends); tok: the policy's tokenizer (the texts the
    scorer reads); scorer: the run's reward model or judge (None: penalties only); queue: its ScorerQueue with
    reward workers (what it scored while generating), else None. Each group's final rewards, shaped inside its
    correctness class (reward.shaped_rewards), and their metrics:
    the scorer's raw outputs (rm/score_mean and rm/score_std over the scored pairs, rm/scored and rm/unscored (NaN:
    no score, reward.RewardModel), or a judge's judge/p_better_mean and its counts: judge/judged, judge/unparsed,
    judge/too_long), the rewards' mean and std, the (correct, wrong) pairs checked and
    t_reward_model (the seconds here: with reward workers, the wait for what the scorer had left) and, with
    reward workers, t_reward_model_busy (the scorer's own seconds, generation's overlap included). Every group
    is checked to keep each correct response's reward above each wrong one's (reward.adjust_rewards'
    guarantee): an AssertionError naming the step if one ever is not.
    With reward.rm_only the verifier's correctness is unread: each group is one class, the check vacuous.
    Multi-rank: each rank's whole scorer scores the groups it generated (a group is generated on one rank), and
    every rank learns every group's scores and the judge's counts (summed), so all shape alike; t_reward_model
    is this rank's, the wait for the slowest rank's scoring included."""
    t0 = time.perf_counter()
    scores = [None] * len(groups)
    judge = isinstance(scorer, PairwiseJudge)
    if scorer is not None:
        # this rank's groups: their rollouts are whole here (Scored.local), the others' are summaries
        mine = [p for p, (_, g) in enumerate(groups) if g[0].local]
        if scores_collectively(scorer):  # a collective (reward.rm_shard): one call of every own row (choice 4)
            rows = [(p, s) for p in mine for s in groups[p][1]]
            flat = scorer.score([groups[p][0].question for p, _ in rows],
                                [tok.decode(s.rollout.text_ids) for _, s in rows])
            flat, own = torch.tensor(flat, dtype=torch.float64), []
            for p in mine:
                own.append((p, flat[:len(groups[p][1])]))
                flat = flat[len(groups[p][1]):]
        else:  # with reward workers: scored while generating, waited for here (choice 3)
            own = [(p, queue.scores([s.rollout for s in groups[p][1]]) if queue is not None else
                    scorer_outputs(scorer, groups[p][0].question, [tok.decode(s.rollout.text_ids)
                                                                   for s in groups[p][1]], groups[p][0].answer))
                   for p in mine]
        if queue is not None:
            queue.forget()
        for p, x in all_gather_list(own):  # every rank's, rank order; one process: its own
            scores[p] = x
        check_outputs(scores, judge, cfg.model, step)  # every rank holds them all: all raise alike
        counts = all_gather_list([dict(scorer.counts)]) if judge else []
    m = {"t_reward_model": time.perf_counter() - t0}
    if queue is not None:  # the scorer's own seconds this step, generation's overlap included
        m["t_reward_model_busy"] = queue.take_busy_s()
    classes = [torch.zeros_like(c) for c in correct] if cfg.rm_only else correct
    rewards = [shaped_rewards(c, [s.rollout.completion_ids for s in g], cfg, scorer=scorer, scores=x,
                              max_new_tokens=max_new_tokens)
               for (_, g), c, x in zip(groups, classes, scores)]
    pairs = 0
    for p, (c, r) in enumerate(zip(classes, rewards)):
        n, inverted = order_violations(c, r)
        if inverted:  # adjust_rewards rules this out; a change to the shaping that breaks it must not train on
            raise AssertionError(f"step {step}: group {p}: {inverted} of {n} (correct, wrong) pairs have the wrong "
                                 f"response's reward at or above the correct one's: rewards {r.tolist()}, correct "
                                 f"{c.tolist()} (reward.adjust_rewards' ordering guarantee broken)")
        pairs += n
    if rewards:
        r = torch.cat(rewards).double()
        m.update({"reward/shaped_mean": r.mean().item(), "reward/shaped_std": r.std(correction=0).item()})
    m["reward/order_pairs_checked"] = pairs  # a violation stops the run (above)
    if scorer is not None and scores:
        x = torch.cat(scores)
        if judge:
            m["judge/p_better_mean"] = x.mean().item()
        else:  # NaN: no score (the pair is past the reward model's context), shaped as nothing
            scored = x[~x.isnan()]
            m.update({"rm/scored": scored.numel(), "rm/unscored": x.numel() - scored.numel()})
            if scored.numel():
                m.update({"rm/score_mean": scored.mean().item(), "rm/score_std": scored.std(correction=0).item()})
    if judge:  # a judge's counts (a GenerativeJudge's; none for the stub): this step's over every rank, then reset
        m.update({f"judge/{k}": sum(c[k] for c in counts) for k in scorer.counts})
        scorer.counts.subtract(dict(scorer.counts))
    return rewards, m


class BlindScorerError(RuntimeError):
    """Most of the scorer's outputs were unusable UNUSABLE_STEPS steps in a row (choice 5): it cannot see what it
    scores; or it returned what no score can be (check_outputs). Every rank finds it alike (train.py's __main__ reports it in one line)."""


def check_outputs(scores: list[torch.Tensor], judge: bool, model: str, step: int):
    """Raise BlindScorerError naming reward.model (`model`) for outputs no scorer can mean: an infinite reward-model
    score (NaN is its "no score"), or a judge's P(better) that is not a probability in [0, 1] (NaN included).
    HFRewardModel checks its own forward; this catches any scorer's, a user's protocol implementation too."""
    for p, x in enumerate(scores):
        bad = ~((x >= 0) & (x <= 1)) if judge else x.isinf()
        if bad.any():
            raise BlindScorerError(f"reward.model={model!r}: group {p} at rl step {step}: {int(bad.sum())} of "
                                   f"{x.numel()} outputs {'not in [0, 1]' if judge else 'infinite'} (first "
                                   f"{x[bad][0].item()}); a judge returns probabilities, a reward model finite scores "
                                   f"(NaN: no score)")


class UnusableStreak:
    """Steps in a row in which more than UNUSABLE_SHARE of the scorer's outputs were unusable (choice 5), read from
    each step's shape_rewards metrics. model: reward.model, which the warning and the error name."""

    def __init__(self, model: str):
        self.model, self.steps = model, 0

    def observe(self, step: int, m: dict):
        """Warn on a step of mostly unusable outputs; raise BlindScorerError on the UNUSABLE_STEPS-th in a row."""
        if m.get("judge/judged"):
            total, bad = m["judge/judged"], m["judge/too_long"] + m["judge/unparsed"]
            what = (f"{m['judge/too_long']} prompts too long for the judge, {m['judge/unparsed']} replies with no "
                    f"verdict")
        elif "rm/unscored" in m:
            total, bad = m["rm/scored"] + m["rm/unscored"], m["rm/unscored"]
            what = f"{bad} conversations past the reward model's context"
        else:  # no scorer, or a stand-in that counts nothing
            return
        if not total or bad <= UNUSABLE_SHARE * total:
            self.steps = 0
            return
        self.steps += 1
        said = (f"reward.model={self.model!r}: {bad} of {total} outputs unusable at rl step {step} ({what}), "
                f"{self.steps} such steps in a row; their shaping is zero")
        if self.steps >= UNUSABLE_STEPS:
            raise BlindScorerError(f"{said}: it cannot see what it scores; give it a longer context (or the run "
                                   f"shorter max_prompt_tokens and sampling.max_new_tokens, or a judge a larger "
                                   f"reward.judge_max_new_tokens), or another reward.model")
        warnings.warn(f"{said}; the run stops at {UNUSABLE_STEPS}")


class ScorerQueue:
    """The scorer (a reward model or judge) on a worker thread of its own, scoring each submitted group while the
    caller goes on (choice 3). `submit` a group's own rollouts with its prompt, completions and reference;
    `scores(rollouts)` waits for and returns their raw outputs [G] fp64 in that order; `take_busy_s` the worker's
    seconds since it was last asked (t_reward_model_busy); `close` stops it."""

    def __init__(self, scorer: Scorer):
        self.scorer, self._busy_s, self._lock = scorer, 0.0, threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer")
        self._where: dict[int, tuple[Future, int]] = {}  # id(rollout) -> its group's job, its place in the group

    def submit(self, rollouts: list, prompt: str, texts: list[str], reference: str):
        job = self._executor.submit(self._score, prompt, texts, reference)
        for i, r in enumerate(rollouts):
            self._where[id(r)] = (job, i)

    def _score(self, prompt: str, texts: list[str], reference: str) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return scorer_outputs(self.scorer, prompt, texts, reference)
        finally:
            with self._lock:
                self._busy_s += time.perf_counter() - t0

    def take_busy_s(self) -> float:
        """The worker's seconds since the last call."""
        with self._lock:
            busy, self._busy_s = self._busy_s, 0.0
        return busy

    def scores(self, rollouts: list) -> torch.Tensor:
        """The submitted rollouts' outputs, waiting for their jobs; a job's error is raised here."""
        return torch.tensor([float(job.result()[i]) for job, i in map(self._where.pop, map(id, rollouts))],
                            dtype=torch.float64)

    def forget(self):
        """Drop what was submitted and never read (a step's leftovers); their jobs still run."""
        self._where.clear()

    def close(self):
        self._executor.shutdown(wait=True, cancel_futures=True)


def submit_groups(queue: ScorerQueue, tok: Tokenizer, generated: list[Rollout], items: list[Item], n: int):
    """Hand a generate call's groups to the run's ScorerQueue (choice 3), their completions decoded by tok (the
    policy's tokenizer): generated holds n rollouts per prompt, in order, each group's prompt and gold in
    items[group_id]."""
    for k in range(0, len(generated), n):
        group = generated[k:k + n]
        item = items[group[0].group_id]
        queue.submit(group, item.question, [tok.decode(r.text_ids) for r in group], item.answer)


def judge_generator(cfg: TrainConfig):
    """How a generative judge (reward.model=judge:<folder>) of a run of cfg (config.TrainConfig) generates:
    builder(model, tok) -> a greedy generator on a NativeEngine of its own holding the judge's weights (cfg.device,
    the run's compute dtype), replies of at most reward.judge_max_new_tokens, their stop token left out. Under
    torchrun each rank holds a whole judge, which judges the groups that rank generated (shape_rewards)."""
    def build(model, tok):
        engine = NativeEngine(model.cfg, eos_id=tok.stop_ids, pad_id=tok.pad_id, device=cfg.device,
                              dtype=cfg.compute_dtype(), num_tokens=tok.enc.n_vocab)
        engine.update_weights(policy_tensors(model), version=0)
        params = SamplingParams(max_new_tokens=cfg.reward.judge_max_new_tokens, temperature=0.0)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            replies = engine.generate(prompts, params, seed=JUDGE_SEED)
            return [r.text_ids for r in replies]
        return generate
    return build
