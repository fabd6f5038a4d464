"""Reward shaping: penalties and a reward model's or judge's score added to the verifier's reward inside its
correctness class, so no correct response's advantage turns negative (arXiv 2512.07710's adjustment against
advantage inversion).

The pure part: DAPO's overlong penalty (arXiv 2503.14476, eq. 13) and a repetition penalty, the scorer's term
(`rm_score`, `judge_score`), `adjust_rewards` and one group's `shaped_rewards`. The RL step's part:
`shape_rewards`, every group of a step shaped and checked against inversion, and `ScorerQueue`, the scorer at work
while the policy still generates. train.collect_rollouts calls shape_rewards when reward.shapes; train.start_run
builds the scorer (reward_model.reward_model_for, a judge on rollout.judge_generator's engine) and, with reward
workers, the queue. What they read is named in their signatures (the reward section, the scorer and its queue;
the texts are the rollouts' own), not a train.Run. The group-relative advantage is GRPO's (arXiv 2402.03300),
whose sign the shaping must never turn against correctness.

Shapes: P, G (letters of the README's legend).

Penalties and shaping:
1. Penalties, in [-1, 0]: DAPO's soft overlong punishment (eq. 13), a repetition
   penalty (the fraction of repeated n-grams) and, for rows that call tools, the share of
   their calls that failed (ToolRL's point, arXiv 2504.13958: tool shaping inside the class).
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
6. Without a verifier (`RewardConfig.rm_only`: prompts without trusted gold answers) the
   reward is the shaping score itself, clamped to [-1, 1]: correctness would be constant in
   every group, where adjust_rewards adds no shaping at all. `order_violations` is the
   check shape_rewards makes on every group that the adjustment kept its order.

Notable choices:
1. Under torchrun each rank's whole scorer scores the groups it generated (reward_model.py's choice 8) and
   every rank learns every group's scores (all_gather_list), so all ranks shape alike.
2. Every group is checked, every step, to keep each correct response's reward above each wrong one's
   (shaping.adjust_rewards' guarantee, arXiv 2512.07710's adjustment against advantage inversion): a broken
   guarantee stops the run naming the step and group, before a step trains on it.
3. With reward.workers > 0 (the reward pool: verifiers score while generation goes on) the scorer does too: each
   generate call's groups go to `ScorerQueue`, one worker thread scoring a group at a time, in submission
   order, exactly as shape_rewards would (scorer_outputs of the group), and shape_rewards waits only
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
from typing import TYPE_CHECKING, Sequence

import torch

from distributed import all_gather_list
from reward import PairwiseJudge, RewardConfig, Scorer
from sampler import Rollout

if TYPE_CHECKING:
    from data import Item
    from filter import Scored

UNUSABLE_SHARE = 0.5  # past this share of a step's scorer outputs unusable, the step's shaping is mostly zero: warn
UNUSABLE_STEPS = 3  # so many such steps in a row stop the run: one is a bad batch, three a scorer that cannot see


# ----------------------------------------------------------------------------- penalties and the adjustment

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


REPETITION_NGRAM = 4
"""repetition_penalty's n-gram length."""


def repetition_penalty(token_ids: Sequence[int]) -> float:
    """-(fraction of the completion's REPETITION_NGRAM-grams that repeat an earlier one), in [-1, 0]; 0 if it has
    none."""
    n = REPETITION_NGRAM
    # over token ids, as generated (nothing to decode); a degenerate loop scores near -1, and a completion
    # shorter than n has no n-grams and no penalty
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    return -(len(grams) - len(set(grams))) / len(grams) if grams else 0.0


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
    A NaN (no score: RewardModel) is left out of its group's mean and shapes exactly 0, as a judge's tie does.

    Raises ValueError unless scale > 0 and 0 <= dead_band < 1.
    """
    if scale <= 0 or not 0 <= dead_band < 1:
        raise ValueError(f"need scale > 0 and 0 <= dead_band < 1; got {scale}, {dead_band}")
    # centred per group: a reward model's offset says nothing about which of G responses is better; tanh
    # bounds an unbounded score to [-1, 1], the range adjust_rewards' guarantee assumes
    x = scores_PG.double()
    u = torch.tanh((x - x.nanmean(-1, keepdim=True)) / scale).nan_to_num(0.0)  # a group all NaN: all 0
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


RM_SCORE_SCALE = 1.0  # reward-model score units per tanh unit in the shaping score (the stub's scores lie in [-1, 1])
def scorer_outputs(scorer: Scorer, prompt: str, texts: list[str], reference: str) -> torch.Tensor:
    """One group's raw scorer outputs [G] fp64: a RewardModel's scores (unbounded), or a PairwiseJudge's
    P(completion beats `reference`) in [0, 1]."""
    G = len(texts)
    if isinstance(scorer, PairwiseJudge):
        return torch.tensor(scorer.compare([prompt] * G, texts, [reference] * G), dtype=torch.float64)
    return torch.tensor(scorer.score([prompt] * G, texts), dtype=torch.float64)


def order_violations(correct_G: torch.Tensor, rewards_G: torch.Tensor) -> tuple[int, int]:
    """(pairs compared, pairs inverted) of one group: every (correct, wrong) pair of responses, inverted when the
    correct one's reward is not above the wrong one's, which adjust_rewards rules out (margin < 1/2)."""
    c = correct_G.bool()
    right, wrong = rewards_G[c].double(), rewards_G[~c].double()
    return right.numel() * wrong.numel(), int((right[:, None] <= wrong[None, :]).sum())


def shaped_rewards(correct_G: torch.Tensor, completion_ids: list[list[int]], cfg: RewardConfig, *, max_new_tokens: int,
                   scorer: Scorer | None = None, prompt: str = "", texts: list[str] | None = None, reference: str = "",
                   scores: torch.Tensor | None = None, failed_share: list[float] | None = None) -> torch.Tensor:
    """One group's final rewards [G] fp32: correctness plus shaping kept inside the correctness class.

    The shaping score s sums DAPO's overlong penalty, the repetition penalty, the failed-call penalty
    (failed_share: per rollout the share of its tool calls that failed, 0 without calls; read with
    cfg.tool_failure_weight) and the scorer's term (a reward model's score through `rm_score`, or a
    judge's verdict against `reference` through `judge_score`), and enters through `adjust_rewards`, so no correct
    response's advantage turns negative. max_new_tokens: the generation limit the overlong
    penalty ramps up to. texts (the decoded completions) and prompt are needed only with a scorer;
    scores: the scorer's outputs for this group (`scorer_outputs`) when the caller already has them
    (train.py times and logs them), else they are computed here. With cfg.rm_only the reward is s itself,
    clamped to [-1, 1], correct_G unread: a group then holds one class, and adjust_rewards would give it
    no shaping at all. Without any shaping, the correctness is returned as it is.
    """
    if not cfg.shapes:  # the common case: no float64 detour, the verifier's rewards as they are
        return correct_G
    G = len(completion_ids)
    # the terms add up and may leave [-1, 1]; adjust_rewards clamps the sum, which is what its guarantee needs
    s_G = torch.zeros(G, dtype=torch.float64)
    if cfg.overlong_buffer:
        s_G += torch.tensor([overlong_penalty(len(x), max_len=max_new_tokens, buffer=cfg.overlong_buffer)
                             for x in completion_ids])
    if cfg.repetition_weight:
        s_G += cfg.repetition_weight * torch.tensor([repetition_penalty(x) for x in completion_ids])
    if cfg.tool_failure_weight:  # a failed call costs inside the class: no tool bonus lifts a wrong answer
        s_G -= cfg.tool_failure_weight * torch.tensor(failed_share, dtype=torch.float64)
    if scorer is not None and scores is None:
        scores = scorer_outputs(scorer, prompt, texts, reference)
    if isinstance(scorer, PairwiseJudge):
        # against the gold answer as the reference: better than gold pushes up, worse pushes down, a tie adds 0
        s_G += cfg.rm_weight * judge_score(scores, dead_band=cfg.judge_dead_band)
    elif scorer is not None:
        s_G += cfg.rm_weight * rm_score(scores, scale=RM_SCORE_SCALE)
    if cfg.rm_only:  # no correctness class to keep: the bounded shaping is the reward
        return s_G.clamp(-1, 1).float()
    return adjust_rewards(correct_G, s_G, margin=cfg.shaping_margin)


# ----------------------------------------------------------------------------- the RL step's shaping

def scores_collectively(scorer: Scorer | None) -> bool:
    """Whether scorer is a sharded reward model (reward.rm_shard): scored in one collective call per rank and step
    (choice 4), never on a ScorerQueue's thread."""
    return scorer is not None and not isinstance(scorer, PairwiseJudge) and scorer.sharded


def shape_rewards(groups: list[tuple[Item, list[Scored]]], correct: list[torch.Tensor], step: int, *,
                  cfg: RewardConfig, max_new_tokens: int, scorer: Scorer | None,
                  queue: ScorerQueue | None) -> tuple[list[torch.Tensor], dict]:
    """groups: the step's (item, [Scored]) pairs; cfg: the run's reward section; max_new_tokens: the generation
    limit (sampling.max_new_tokens, where the overlong penalty ends); scorer: the run's reward model or judge
    (None: penalties only); queue: its ScorerQueue with reward workers (what it scored while generating), else
    None. Each group's final rewards, shaped inside its correctness class (shaped_rewards), and their metrics:
    the scorer's raw outputs (rm/score_mean and rm/score_std over the scored pairs, rm/scored and rm/unscored (NaN:
    no score, reward.RewardModel), or a judge's judge/p_better_mean and its counts: judge/judged, judge/unparsed,
    judge/too_long), the rewards' mean and std, the (correct, wrong) pairs checked and
    t_reward_model (the seconds here: with reward workers, the wait for what the scorer had left) and, with
    reward workers, t_reward_model_busy (the scorer's own seconds, generation's overlap included). Every group
    is checked to keep each correct response's reward above each wrong one's (shaping.adjust_rewards'
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
            flat = scorer.score([groups[p][0].question for p, _ in rows], [s.rollout.text for _, s in rows])
            flat, own = torch.tensor(flat, dtype=torch.float64), []
            for p in mine:
                own.append((p, flat[:len(groups[p][1])]))
                flat = flat[len(groups[p][1]):]
        else:  # with reward workers: scored while generating, waited for here (choice 3)
            own = [(p, queue.scores([s.rollout for s in groups[p][1]]) if queue is not None else
                    scorer_outputs(scorer, groups[p][0].question, [s.rollout.text for s in groups[p][1]],
                                   groups[p][0].answer))
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
                              max_new_tokens=max_new_tokens,
                              failed_share=[s.rollout.tool_failures / max(s.rollout.tool_calls, 1) for s in g]
                              if cfg.tool_failure_weight else None)
               for (_, g), c, x in zip(groups, classes, scores)]
    pairs = 0
    for p, (c, r) in enumerate(zip(classes, rewards)):
        n, inverted = order_violations(c, r)
        if inverted:  # adjust_rewards rules this out; a change to the shaping that breaks it must not train on
            raise AssertionError(f"step {step}: group {p}: {inverted} of {n} (correct, wrong) pairs have the wrong "
                                 f"response's reward at or above the correct one's: rewards {r.tolist()}, correct "
                                 f"{c.tolist()} (shaping.adjust_rewards' ordering guarantee broken)")
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
    scores; or it returned what no score can be (check_outputs). Every rank finds it alike (train.py's __main__
    reports it in one line)."""


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


def submit_groups(queue: ScorerQueue, generated: list[Rollout], items: list[Item], n: int):
    """Hand a generate call's groups to the run's ScorerQueue (choice 3), with their completions' texts (Rollout.text):
    generated holds n rollouts per prompt, in order, each group's prompt and gold in items[group_id]."""
    for k in range(0, len(generated), n):
        group = generated[k:k + n]
        item = items[group[0].group_id]
        queue.submit(group, item.question, [r.text for r in group], item.answer)
