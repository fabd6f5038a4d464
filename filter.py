"""Zero-variance prompt elimination in three stages, with counts of what each stage saved.

A group whose G rewards are all equal has all-zero group-relative advantages, so its
rollouts carry no policy gradient (DAPO, arXiv 2503.14476 sec. 3.2). The seed paper
(arXiv 2512.07710) removes such prompts as early as it can:

- Stage 1, before rollout (`PromptHistory`, `pre_rollout_filter`): each prompt's last
  pass rate and the step it was seen. A prompt last seen all-correct or all-wrong is
  skipped with probability skip_prob * 2^(-(step - last_step) / half_life): temporal
  consistency makes it likely to be zero-variance again (GRESO, arXiv 2506.02177), and the
  decay brings it back as the policy moves on. An offline pass-rate file (JSONL of
  {"id", "pass_rate"}, measured by a smaller model) can seed the history once.
- Stage 2, during rollout (`probe_decisions`): k probe rollouts of each prompt first; a
  prompt whose probes all got the same reward stops there (unless its history makes the
  rest likely to differ: reading 3), its other G - k rollouts are never generated; the
  rest get G - k more (or G' - k, G' > G, to spend the savings on prompts that are
  informative).
- Stage 3, after rollout (`stage3`: `post_rollout_filter`, espo.zvp_token_advantages): drop the groups
  that are still zero-variance, or keep them with RL-ZVP's entropy-shaped token
  advantages (arXiv 2509.21880): all correct A_t = a H_t, all wrong A_t = -a (max_t H - H_t).
- Over-sampling (`oversample_size`, DAPO's dynamic sampling): more prompts, in rounds,
  until the step has its target number of informative groups.

Every function here decides from plain data (rewards, lengths, history). train.py's `draw_groups` calls stages 1
and 2 and over-sampling around its generate-and-score rounds (over-sampling's draws before stage 3), its
`collect_rollouts` calls `stage3` once every group is scored (and shaped), and the trainer computes RL-ZVP's token
advantages once it has pi_old's entropy.

Readings chosen:
1. Stage 1's decay is in training steps since the prompt's last rollout, and each record
   gets one uniform draw, compared with the decayed probability at every visit: a prompt
   drawn many times in a step (over-sampling a small pool) still comes back on the
   schedule; with a fresh draw per visit its return chance would compound per visit
   (bench/zve.py compares both). GRESO instead raises the skip probability with
   consecutive zero-variance epochs and tunes a base exploration rate; the seed paper
   asks for a probability that decays so prompts return.
2. Offline pass rates count as observed at step 0; online observations replace them.
3. Stage 2's "agree" means all k probe rewards are equal (k >= 2); a stopped prompt's k
   probes stay a group of size k, which Stage 3 drops or reshapes like any other. The
   stop is a decision, not a rule: a prompt stops when the chance that its other G - k
   rollouts would agree with the probes as well is at least `stop_threshold`
   (`rest_agree_probability`: a Jeffreys Beta(1/2, 1/2) prior on the chance of the probes'
   outcome, updated with the prompt's last group and the probes; rewards read as pass
   rates in [0, 1]). Without history that chance is >= 0.52 for every k < G <= 8, so at
   the default 0.5 agreeing probes stop a new prompt, as the seed paper does; a prompt
   last seen informative (e.g. 4 of 8 correct) mostly goes on, as its probes agree by
   chance more often than it turns zero-variance, and a false stop loses the group.
   Against never stopping a prompt last seen informative, it spends as many tokens per
   informative group and generates fewer zero-variance groups in full (bench/zve.py).
4. RL-ZVP: H_t is the full-vocabulary entropy of pi_old at completion token t (the
   trainer's recomputation, detached), max_t over the same response's completion tokens,
   detached; a is a config value.
5. Tokens "saved" by stages 1 and 2 were never generated, so they are estimates: the
   predicted completion length (stage 1) or the prompt's mean probe length (stage 2)
   times the rollouts not generated. Stage 3 counts the real tokens of dropped groups.

Shapes: P, G, T (letters of the README's legend).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from rules import FRACTION, NON_NEGATIVE, PATH, POSITIVE, check_fields, integer, one_of

MIN_INFORMATIVE_RATE = 0.05  # over-sampling: below this observed rate, draw as if it were this (bounds one round)
STAGE1_COUNTS = ("prompts_skipped", "rollouts_saved", "tokens_saved_est")  # what pre_rollout_filter counts
STAGE2_COUNTS = ("prompts_stopped", "rollouts_saved", "tokens_saved_est", "rollouts_added")  # probe_decisions'
OFFLINE_WEIGHT = 8  # rollouts an offline pass rate (or a record without a count) weighs as, in stage 2's posterior
JEFFREYS = 0.5  # Beta(1/2, 1/2) prior of stage 2's stop decision


# ----------------------------------------------------------------------------- stage 1

@dataclass
class PromptRecord:
    """What stages 1 and 2 remember of a prompt: its last group."""
    pass_rate: float  # mean reward of the prompt's last group (probes included)
    last_step: int  # training step of that group
    n: int = OFFLINE_WEIGHT  # rollouts in that group (offline rates count as one group of OFFLINE_WEIGHT)
    draw: float | None = None  # stage 1's uniform draw for this record, made at its first skip decision


class PromptHistory:
    """Per-prompt pass rate and last step seen, keyed by any hashable prompt id."""

    def __init__(self):
        self.records: dict[Any, PromptRecord] = {}

    def observe(self, key, pass_rate: float, step: int, n: int = OFFLINE_WEIGHT):
        """Record a group of n rollouts with mean reward pass_rate seen at `step`."""
        self.records[key] = PromptRecord(pass_rate, step, n)

    def state_dict(self) -> dict:
        """Plain data for a checkpoint: {"records": {key: (pass_rate, last_step, n, draw)}}."""
        return {"records": {k: (r.pass_rate, r.last_step, r.n, r.draw) for k, r in self.records.items()}}

    def load_state_dict(self, state: dict):
        """Replace the history with a `state_dict()`'s (insertion order kept; 2-tuples of older
        checkpoints get n = OFFLINE_WEIGHT and no draw)."""
        self.records = {k: PromptRecord(*rec) for k, rec in state["records"].items()}

    def load_offline(self, path: str) -> int:
        """Record pass rates from a JSONL file of {"id": ..., "pass_rate": p}, as seen at step 0; returns the rows read.

        Raises ValueError on a row without both fields or a pass rate outside [0, 1].
        """
        n = 0
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {i + 1}: not JSON ({e.msg}): {line.strip()[:80]!r}") from None
                rate = row.get("pass_rate") if isinstance(row, dict) else None
                # bool is an int: True is no pass rate; NaN fails both comparisons, so it is refused too
                if (not isinstance(row, dict) or "id" not in row or isinstance(rate, bool) or not isinstance(rate, (int, float))
                        or not 0.0 <= rate <= 1.0):
                    raise ValueError(f"{path} line {i + 1}: need 'id' and a number 'pass_rate' in [0, 1], got "
                                     f"{str(row)[:80]}")
                self.observe(row["id"], float(rate), 0)
                n += 1
        return n

    def skip_probability(self, key, step: int, *, skip_prob: float, half_life: float) -> float:
        """skip_prob * 2^(-(step - last_step) / half_life) if the last pass rate was 0 or 1, else 0."""
        rec = self.records.get(key)
        if rec is None or 0.0 < rec.pass_rate < 1.0:  # unseen, or last seen informative: never skipped
            return 0.0
        # halves every half_life steps: the policy has moved on, so the prompt may have changed class (reading 1)
        return skip_prob * 2.0 ** (-max(0, step - rec.last_step) / half_life)


def pre_rollout_filter(keys: list, history: PromptHistory, step: int, cfg: FilterConfig, *, group_size: int,
                       rng: random.Random, predicted_tokens: list[float]) -> tuple[list[bool], dict]:
    """Stage 1: keep mask over `keys` and counts: prompts_skipped, rollouts_saved, tokens_saved_est.

    A prompt is skipped when its record's uniform draw (made from rng at the first decision
    after the record was written, then kept) is below its skip probability now, so the chance
    that it is still skipped at step t is that probability, however often it is drawn.
    group_size: the rollouts a prompt would get; predicted_tokens: expected completion length of each
    prompt (both for the estimates of what was saved).
    """
    keep = []
    for k in keys:  # a prompt drawn twice in a step gets the same decision: its record's draw is kept
        p = history.skip_probability(k, step, skip_prob=cfg.skip_prob, half_life=cfg.skip_half_life)
        if p > 0:
            rec = history.records[k]
            rec.draw = rng.random() if rec.draw is None else rec.draw  # one draw per record (reading 1)
        keep.append(not (p > 0 and history.records[k].draw < p))
    skipped = [i for i, kept in enumerate(keep) if not kept]
    return keep, {"prompts_skipped": len(skipped), "rollouts_saved": len(skipped) * group_size,
                  "tokens_saved_est": float(sum(predicted_tokens[i] for i in skipped)) * group_size}


# ----------------------------------------------------------------------------- stage 2

@dataclass
class Scored:
    """One scored rollout, as the stages see it."""
    reward: float
    num_tokens: int  # generated tokens
    rollout: Any = None  # the rollout (sampler.Rollout), or under torchrun another rank's summary of one
    reason: str = "ok"  # how scoring went: "ok", "timeout" or "error: <type>" (scoring.RewardPool); such a reward is 0
    local: bool = True  # the rollout is this rank's whole one (False: another rank's summary, under torchrun)


def rest_agree_probability(probe_reward: float, probe_size: int, rest: int, record: PromptRecord | None) -> float:
    """Posterior predictive chance that `rest` more rollouts all get the agreeing probes' outcome.

    The chance q of that outcome (reward probe_reward read as correct if >= 0.5, else wrong)
    has a Jeffreys Beta(1/2, 1/2) prior, updated with the prompt's last group (record: its pass
    rate as a soft count over record.n rollouts; None = no history) and the probe_size probes;
    returns E[q^rest] = prod_{i < rest} (a + i) / (a + b + i) under the posterior Beta(a, b).
    """
    # the last group as soft counts: `same` rollouts had the probes' outcome, `other` the opposite one
    same = 0.0 if record is None else record.n * (record.pass_rate if probe_reward >= 0.5 else 1.0 - record.pass_rate)
    other = 0.0 if record is None else record.n - same
    a, b = JEFFREYS + same + probe_size, JEFFREYS + other  # posterior Beta(a, b) of q: prior + history + probes
    # E[q^rest] = B(a + rest, b) / B(a, b), written as a product: the chance all `rest` draws match
    return math.prod((a + i) / (a + b + i) for i in range(rest))


def probe_decisions(probes: list[list[Scored]], records: list[PromptRecord | None], cfg: FilterConfig, *,
                    group_size: int) -> tuple[list[int], dict]:
    """Stage 2: the prompts whose probes say go on (indices into probes), and counts.

    probes[i]: prompt i's cfg.probe_size scored probe rollouts; records[i]: its last group
    (None = never seen); group_size: G. A prompt whose probes agree stops if rest_agree_probability(...)
    >= cfg.probe_stop_threshold: without history, every prompt whose probes agree (reading 3).
    Counts: prompts_stopped, rollouts_saved, tokens_saved_est, rollouts_added (by enlarging).
    """
    k, rest = cfg.probe_size, group_size - cfg.probe_size
    stopped = [i for i, g in enumerate(probes) if not is_informative(g)
               and rest_agree_probability(g[0].reward, k, rest, records[i]) >= cfg.probe_stop_threshold]
    go_on = sorted(set(range(len(probes))) - set(stopped))
    # a stopped prompt would have spent `rest` more rollouts of about its probes' mean length (reading 5)
    tokens = float(sum(sum(s.num_tokens for s in probes[i]) / k for i in stopped)) * rest
    return go_on, {"prompts_stopped": len(stopped), "rollouts_saved": len(stopped) * rest, "tokens_saved_est": tokens,
                   "rollouts_added": len(go_on) * max(0, cfg.enlarged_group_size - group_size)}


def is_informative(group: list[Scored]) -> bool:
    """A group trains the policy only if its rewards differ (else every advantage is zero)."""
    return len({s.reward for s in group}) > 1


@dataclass(frozen=True)
class FilterConfig:
    """The zero-variance stages: the run's `filter` section (by default no stage 1-2, stage 3 drops). Raises
    ValueError on a field its rule refuses (`RULES`), enlargement without probes, or a pass-rate file no
    stage reads; probe_size and enlarged_group_size against the group size are config.RELATIONS'."""
    skip_prob: float = 0.0
    """Stage 1: probability of skipping a prompt last seen all-correct or all-wrong, at once (0 = off)."""
    skip_half_life: float = 200.0
    """Stage 1: RL steps over which that skip probability halves, so skipped prompts come back."""
    pass_rate_file: str = ""
    """Stage 1: JSONL of {"id": question, "pass_rate": p} (e.g. from a smaller model), read once ("" = none)."""
    probe_size: int = 0
    """Stage 2: probe rollouts k per prompt; the other G - k are generated only if their rewards differ (0 = off)."""
    probe_stop_threshold: float = 0.5
    """Stage 2: agreeing probes stop a prompt when the other G - k would agree too with at least this chance, a
    posterior given the prompt's last group (rest_agree_probability); 0 = always stop when they agree."""
    enlarged_group_size: int = 0
    """Stage 2: rollouts of a prompt whose probes differ, >= group_size (0 = group_size)."""
    zero_variance: str = "drop"
    """Stage 3: 'drop' zero-variance groups, or 'rl-zvp' to train on them with entropy-shaped token advantages."""
    zvp_alpha: float = 0.1
    """RL-ZVP scale a: all correct A_t = a H_t, all wrong A_t = -a (max H - H_t) (arXiv 2509.21880)."""
    oversample_rounds: int = 0
    """Extra rounds of prompts drawn per step until prompts_per_step groups are informative (0 = none)."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "skip_prob": FRACTION,
        "skip_half_life": POSITIVE,
        "pass_rate_file": PATH,
        "probe_size": integer(0, why="0 = off, else 2..group_size - 1: two probes can disagree"),
        "probe_stop_threshold": FRACTION,
        "enlarged_group_size": integer(0, why="0 = group_size"),
        "zero_variance": one_of("drop", "rl-zvp"),
        "zvp_alpha": NON_NEGATIVE,
        "oversample_rounds": integer(0),
    }

    def __post_init__(self):
        check_fields(self)
        if self.probe_size == 1:
            raise ValueError("probe_size=1: need 0 (off) or at least 2 (one probe always agrees with itself)")
        if self.enlarged_group_size and not self.probe_size:
            raise ValueError(f"enlarged_group_size={self.enlarged_group_size}: enlarges the groups whose probes "
                             f"differ, so it needs probe_size > 0 (probe_size=0)")
        if self.pass_rate_file and not (self.skip_prob > 0 or self.probe_size > 0):
            raise ValueError(f"pass_rate_file={self.pass_rate_file!r}: read by stage 1 (skip_prob > 0) and stage 2 "
                             f"(probe_size > 0), and both are off")

    @property
    def keep_zero_variance(self) -> bool:
        """Stage 3 keeps zero-variance groups (RL-ZVP): every group counts toward the step's target."""
        return self.zero_variance == "rl-zvp"

    def rest_size(self, group_size: int) -> int:
        """Stage 2: rollouts still to generate for a prompt whose probes go on (G - k, or G' - k enlarged)."""
        return max(group_size, self.enlarged_group_size) - self.probe_size


def oversample_size(groups: list[list[Scored]], drawn: int, target: int, cfg: FilterConfig) -> int:
    """Over-sampling: prompts to draw in the next round, 0 once `target` groups are informative.

    groups: the step's groups so far (from `drawn` prompts). What is missing is divided by
    the informative rate seen so far this step (at least MIN_INFORMATIVE_RATE), and one
    round draws at most `target` prompts.
    """
    # with RL-ZVP every group trains, so every group counts toward the target
    informative = sum(cfg.keep_zero_variance or is_informative(g) for g in groups)
    if informative >= target:
        return 0
    rate = max(informative / drawn, MIN_INFORMATIVE_RATE)  # floored: a step with none yet still draws a bounded round
    return min(target, math.ceil((target - informative) / rate))  # expected draws to fill the gap


# ----------------------------------------------------------------------------- stage 3

def post_rollout_filter(rewards_PG, lengths_PG, correct_PG=None) -> tuple[torch.Tensor, dict]:
    """Keep mask [P] bool (True = the group's rewards vary) and counts of what was dropped.

    rewards_PG / lengths_PG / correct_PG: a [P, G] tensor or a list of P 1-D tensors
    (groups may differ in size): rewards, completion lengths in tokens, and optionally
    0/1 correctness. Counts: groups, groups_dropped, all_correct / all_wrong (dropped groups
    that are all correct / the rest; without correct_PG, all correct means the common
    reward is the batch maximum and positive), rollouts_dropped, tokens_dropped (generated
    tokens spent on dropped groups), zero_variance_frac.
    Raises ValueError if a group's rewards and lengths differ in shape or are not 1-D.
    """
    rewards, lengths = list(rewards_PG), list(lengths_PG)
    if len(rewards) != len(lengths) or any(r.dim() != 1 or r.shape != n.shape for r, n in zip(rewards, lengths)):
        raise ValueError(f"rewards {[tuple(r.shape) for r in rewards][:4]} and lengths "
                         f"{[tuple(n.shape) for n in lengths][:4]} must be the same groups of 1-D tensors")
    zero_var = [bool((r == r[0]).all()) for r in rewards]  # equal rewards: every advantage is 0, no gradient
    if correct_PG is not None:
        all_correct = [z and bool(c.all()) for z, c in zip(zero_var, correct_PG)]
    else:
        top = max((float(r.max()) for r in rewards), default=0.0)
        all_correct = [z and float(r[0]) == top and top > 0 for z, r in zip(zero_var, rewards)]
    P = len(rewards)
    stats = {
        "groups": P,
        "groups_dropped": sum(zero_var),
        "all_correct": sum(all_correct),
        "all_wrong": sum(zero_var) - sum(all_correct),
        "rollouts_dropped": sum(len(r) for r, z in zip(rewards, zero_var) if z),
        "tokens_dropped": int(sum(int(n.sum()) for n, z in zip(lengths, zero_var) if z)),
        "zero_variance_frac": sum(zero_var) / P if P else 0.0,
    }
    return torch.tensor([not z for z in zero_var], dtype=torch.bool), stats


def stage3(rewards_PG, lengths_PG, correct_PG, cfg: FilterConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Stage 3, after rollout: (keep [P] bool, zero-variance [P] bool, counts). A group whose rewards are all equal
    is dropped (`post_rollout_filter`), or with RL-ZVP (cfg.keep_zero_variance) kept, marked zero-variance for the
    trainer to give token advantages, and counted as zvp_groups instead of dropped."""
    keep_P, counts = post_rollout_filter(rewards_PG, lengths_PG, correct_PG)
    zero_var_P = ~keep_P
    if cfg.keep_zero_variance:  # RL-ZVP (arXiv 2509.21880): nothing is dropped
        keep_P = torch.ones_like(keep_P)
        counts.update(zvp_groups=counts["groups_dropped"], groups_dropped=0, rollouts_dropped=0, tokens_dropped=0)
    return keep_P, zero_var_P, counts
