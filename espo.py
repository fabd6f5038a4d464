"""Policy losses, advantages and the train-inference corrections, as pure functions over tensors.

`policy_loss(logp, old_logp, adv, mask, LossConfig)` is the RL loss of the trainer: a
per-token objective obj_t (to maximise) of one of seven losses (ESPO and the GRPO family it
builds on, below), optionally weighted against the train-inference mismatch (TIS, IcePop)
and penalised by a KL to a reference, then aggregated to a scalar (one of five
aggregations); it returns minus that scalar and float metrics. `LossConfig` is built and
checked once per run. Also here: group-relative advantages (`ragged_group_advantages`; RL-ZVP's
token advantages for the zero-variance groups stage 3 keeps, `zvp_token_advantages`) and
the mismatch metrics of engine against trainer (`mismatch_metrics`). Every formula is
checked against a float64 per-sequence loop written from the papers (tests/reference_losses.py).
Shapes: B, T, G, P, Q (letters of the README's legend).

Advantages (GRPO, arXiv 2402.03300 sec. 4.1.2): for the G rollouts of one prompt with
rewards r_1..r_G, A_i = (r_i - mean(r)) / (std(r) + eps); without the std (Dr.GRPO,
arXiv 2503.20783 sec. 3.2); or with the std taken over the whole batch.

Token ratio w_t = pi_theta(y_t) / pi_old(y_t). The losses (A = A_i of the token's sequence):
- grpo: GRPO / DAPO token clip, min(w_t A, clip(w_t, 1 - eps_low, 1 + eps_high) A)
  (arXiv 2402.03300 eq. 3; DAPO arXiv 2503.14476 eq. 8, clip-higher eps_high > eps_low).
- drgrpo: the same token clip, aggregated by a constant: sum over tokens / max_tokens,
  mean over sequences (Dr.GRPO, arXiv 2503.20783 sec. 3.2; the constant is the
  generation budget in the paper's released code).
- gspo: sequence ratio s_i = exp(mean_t log w_t), min(s_i A, clip(s_i, 1 - eps_low,
  1 + eps_high) A) (GSPO, arXiv 2507.18071 eq. 5 and 7).
- gspo-token: s_t = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)], clipped per token
  (arXiv 2507.18071 eq. 13-14); its value and gradient equal GSPO's when A is per sequence.
- gmpo: geometric mean of the token terms, sgn(A) (prod_t |min(w_t A, clip(w_t, e^-eps_low,
  e^eps_high) A)|)^(1/|y|) (GMPO, arXiv 2507.20673 sec. 3), computed in log space as
  A exp(mean_t sgn(A) min(sgn(A) log w_t, sgn(A) clip(log w_t, -eps_low, eps_high))).
- cispo: sg[clip(w_t, 1 - eps_low, 1 + eps_high)] A log pi_theta(y_t) (MiniMax-M1,
  arXiv 2506.13585 eq. 4-5): the clipped IS weight is a constant coefficient, so a
  clipped token still gets a gradient.
- espo: below.

ESPO (arXiv 2512.00499): the tokens of each sequence are split by their entropy under
the old policy, e_t = -sum_v pi_old(v) log pi_old(v), into entropy bins (the paper's
"groups"; here a group is a prompt's rollouts). Default two
bins: the top 20 percent highest-entropy tokens, and the rest; bins need not be contiguous.
Each bin tau has a length-normalised ratio s_tau = exp(mean_{t in tau} log w_t), used in
the GSPO-token stop-gradient form s_t = sg[s_tau] * pi_theta(y_t) / sg[pi_theta(y_t)]
(GSPO, arXiv 2507.18071 eq. 13), and its own symmetric clip range
eps_tau = alpha * mean_{t in tau} e_t / log|V| (alpha = 0.02). The objective is the mean
over tokens in a bin, then over the non-empty bins of a sequence, then over
sequences, of min(s_t A, clip(s_t, 1 - eps_tau, 1 + eps_tau) A). The loss is its negative.

Optional terms: a KL penalty to a reference policy, obj_t - kl_coef * k_t, with k1 =
log pi_theta - log pi_ref or k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 (GRPO
arXiv 2402.03300 eq. 4; Schulman 2020, "Approximating KL divergence"). Train-inference
corrections from the engine's logprobs, k_t = pi_old(y_t) / pi_infer(y_t): TIS multiplies
obj_t by min(k_t, C) (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", fengyao.notion.site/off-policy-rl); IcePop by M(k_t) = k_t if
a <= k_t <= b else 0 (Ring-1T, arXiv 2510.18855 sec. 4, a = 0.5, b = 5).

Aggregations (names as in verl): token-mean (sum / all tokens of the batch, DAPO),
seq-mean-token-mean (per-sequence mean, then mean over sequences: GRPO, GSPO),
seq-mean-token-sum (per-sequence sum, then mean), seq-mean-token-sum-norm (per-sequence
sum / max_tokens, then mean: Dr.GRPO), seq-mean-bin-mean-token-mean (ESPO only).

Readings chosen where the printed ESPO paper is ambiguous:
1. Token-ratio denominator: pi_old is the trainer's own recomputation of the rollout
   policy (a no-grad forward with the engine's routes replayed), not the engine's
   logprobs; those only feed train-inference mismatch metrics and TIS / IcePop.
2. Advantage mask: every completion token of a sequence carries that sequence's A_i in
   every entropy bin; only padding (mask 0) is excluded. No token is dropped for low
   entropy; low-entropy tokens form their own bin with a tighter clip.
3. Bin sizes: the top bin takes ceil(top_frac * n_valid) tokens (at least one), the
   remaining ranks split evenly into num_bins - 1 bins; empty bins are skipped in
   the mean over bins. Ties in entropy are broken by position (stable sort). The ceil is
   exact, in integers, on the decimal top_frac is written as (its shortest repr: 0.6 at
   25 tokens is 15, where fp32 gives 16), not on its binary float.
4. |V| in eps_tau is the model's full vocabulary size (the maximum possible entropy is log|V|).
5. ESPO's own aggregation is the bin mean; under another aggregation the entropy
   bins still set each token's ratio and clip range but no longer weight the tokens.

Other choices:
6. Sequence-level losses (gspo, gmpo) place the sequence's objective on each of its tokens,
   so every aggregation applies: seq-mean-token-mean is the papers' form, token-mean
   weights a sequence by its length.
7. Batch-level std (std_over="batch") is the std of the group-centred rewards over the
   whole batch (REINFORCE++-baseline, arXiv 2501.03262): prompt difficulty, already
   removed by the group mean, does not inflate it.
8. TIS / IcePop weights multiply the policy term only, not the KL term (as in the IcePop
   objective); tokens IcePop zeroes still count in every denominator (its 1/|y_i|).
9. CISPO's value is the paper's literal sg[w] A log pi, so it is not comparable with the
   other losses' values; only its gradient is. The paper sets no lower bound and does not
   give its upper one: the defaults are eps_low = 1 (weight >= 0) and DAPO's 0.28.
10. KL estimators are evaluated on tokens sampled from pi_old, as GRPO does.
11. Advantages are computed in float64 and returned in fp32; a group whose rewards are all
   equal (max == min) is centred to exactly 0, since its float mean can miss the rewards by
   an ulp, and that residual over std + eps would be an advantage of order 1.
12. Subgradient of every clip (torch.clamp, ESPO's too): at a ratio exactly on a clip bound
   the clip passes the gradient whole, so min(w A, clip(w) A) there has w's gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from rules import FLAG, NON_NEGATIVE, POSITIVE, check_fields, integer, number, one_of, optional, pair

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                "seq-mean-bin-mean-token-mean")
# Each loss's aggregation in its paper, used when `aggregation` is None.
PAPER_AGGREGATION = {"grpo": "token-mean", "drgrpo": "seq-mean-token-sum-norm", "gspo": "seq-mean-token-mean",
                     "gspo-token": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean", "cispo": "token-mean",
                     "espo": "seq-mean-bin-mean-token-mean"}
LOSS_TYPES = tuple(PAPER_AGGREGATION)  # a loss is known by its entry above: one place to name a new one
# (eps_low, eps_high) from each paper, used when a clip eps is None: DAPO sec. 3.1; Dr.GRPO's
# PPO clip; GSPO sec. 5.1 (sequence ratios sit orders of magnitude closer to 1); GMPO's
# (e^-0.4, e^0.4), in log space; CISPO: no lower bound, upper bound undisclosed (reading 9).
PAPER_CLIP_EPS = {"grpo": (0.2, 0.28), "drgrpo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "gspo-token": (3e-4, 4e-4),
                  "gmpo": (0.4, 0.4), "cispo": (1.0, 0.28)}
KL_ESTIMATORS = ("k1", "k3")
ADV_EPS = 1e-6  # added to the std so a zero-variance group divides by a positive number


# ----------------------------------------------------------------------------- advantages

def group_advantages(rewards_PG: torch.Tensor, *, scale_by_std: bool = True, std_over: str = "group",
                     eps: float = ADV_EPS) -> torch.Tensor:
    """A [P, G] fp32 = (r - mean_g r) / (std + eps); without the std if scale_by_std is False.

    rewards_PG: [P, G], any real dtype. std_over "group": the std of each prompt's G rewards
    (GRPO, arXiv 2402.03300 sec. 4.1.2); "batch": the std of all P*G group-centred rewards
    (reading 7). std is the unbiased sample std, as in the GRPO reference code. Computed in
    float64, rounded to fp32 once at the end (reading 11). Each group's advantages sum to zero, and a
    group whose rewards are all equal gets advantages of exactly zero, whatever their values and dtype.
    Raises ValueError unless rewards are 2-D with G >= 2, or on an unknown std_over.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards must be [P, G] with G >= 2, got shape {tuple(rewards_PG.shape)}")
    if std_over not in ("group", "batch"):
        raise ValueError(f"std_over={std_over!r}; valid: 'group', 'batch'")
    adv = centred_rewards(rewards_PG)  # (P, G) float64
    if scale_by_std:
        # an all-equal group is exactly 0 already; eps keeps its std of 0 from making 0/0
        std = rewards_PG.double().std(dim=1, keepdim=True) if std_over == "group" else adv.std()
        adv = adv / (std + eps)
    return adv.float()


def centred_rewards(rewards_PG: torch.Tensor) -> torch.Tensor:
    """r - mean_g r [P, G] float64, exactly 0 in every group whose rewards are all equal (reading 11)."""
    r = rewards_PG.double()
    # the mean of G equal rewards can miss them by an ulp (15 x 123.456 in fp32 or fp64), and dividing that
    # residual by std + eps would turn a group with no signal into advantages of order 1
    equal_P1 = rewards_PG.amax(dim=1, keepdim=True) == rewards_PG.amin(dim=1, keepdim=True)
    return torch.where(equal_P1, 0.0, r - r.mean(dim=1, keepdim=True))


def ragged_group_advantages(rewards_P: list[torch.Tensor], *, scale_by_std: bool = True,
                            std_over: str = "group") -> list[torch.Tensor]:
    """`group_advantages` of groups that may differ in size (stage 2 stops some at its k probes):
    one [G_p] fp32 tensor per group, one batched call per size. With std_over "batch" the std is
    taken over every group's centred rewards together, whatever their sizes."""
    adv: list = [None] * len(rewards_P)
    batch_std = None
    if scale_by_std and std_over == "batch":
        batch_std = torch.cat([centred_rewards(r[None])[0] for r in rewards_P]).std()  # float64
    for size in sorted({len(r) for r in rewards_P}):  # groups of one size stack into one [P', G] call
        idx = [i for i, r in enumerate(rewards_P) if len(r) == size]
        stacked_PG = torch.stack([rewards_P[i] for i in idx])
        if batch_std is None:
            rows = group_advantages(stacked_PG, scale_by_std=scale_by_std, std_over=std_over)
        else:
            rows = (centred_rewards(stacked_PG) / (batch_std + ADV_EPS)).float()
        for i, a in zip(idx, rows):
            adv[i] = a
    return adv


def zvp_token_advantages(entropy_T: torch.Tensor, *, correct: bool, alpha: float) -> torch.Tensor:
    """RL-ZVP advantages [T] fp32 of one response of a zero-variance group (arXiv 2509.21880).

    entropy_T: pi_old's entropy (nats) at the response's completion tokens. All correct:
    A_t = alpha * H_t (>= 0); all wrong: A_t = -alpha * (max_t H - H_t) (<= 0), so confident
    tokens of a wrong answer are pushed down hardest. alpha >= 0 (filter.FilterConfig's rule for zvp_alpha):
    the zero-variance groups stage 3 keeps get these instead of their all-zero group advantages.
    """
    h = entropy_T.detach().float()
    if h.numel() == 0:
        return h
    # correct: reward uncertain tokens most (they were luckiest); wrong: push confident tokens down most
    return alpha * h if correct else -alpha * (h.max() - h)


# ----------------------------------------------------------------------------- entropy bins

def top_bin_size(num_valid: int, top_frac: float) -> int:
    """Tokens in ESPO's top entropy bin of a sequence of num_valid tokens: ceil(top_frac * num_valid), at
    least one, computed exactly on the decimal top_frac is written as (reading 3)."""
    # float arithmetic can land just above an integer: 0.6 * 25 is 15.000001 in fp32 and 0.28 * 25 is
    # 7.000000000000001 in fp64, and ceil takes one token too many; str() gives the shortest decimal that
    # reads back as this float, i.e. the value as written (0.6, not 0.59999999999999997779)
    num, den = Fraction(str(top_frac)).as_integer_ratio()
    return max(1, -(-num_valid * num // den))  # ceil of a ratio of integers


def entropy_bins(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, *, top_frac: float, num_bins: int) -> torch.Tensor:
    """Entropy-bin index [B, T] int64 per token (0 = highest entropy); -1 on padding.

    Bin 0 holds the `top_bin_size` = ceil(top_frac * n_valid) highest-entropy valid tokens of each
    sequence; the rest of the ranks are split evenly into num_bins - 1 bins (ESPO,
    arXiv 2512.00499; readings 3). num_bins >= 1 and 0 < top_frac <= 1: LossConfig's rules.
    """
    valid = mask_BT.bool()
    n_valid_B1 = valid.sum(-1, keepdim=True)  # (B, 1) completion tokens per sequence
    if num_bins == 1:
        return torch.where(valid, 0, -1)
    # rank 0 = highest entropy; padding sorts last
    order_BT = entropy_BT.masked_fill(~valid, -math.inf).argsort(dim=-1, descending=True, stable=True)
    rank_BT = order_BT.argsort(dim=-1)  # (B, T) inverse permutation: each token's rank
    # bin 0's size in Python integers, one per sequence (B numbers; the loss's metrics read the device anyway)
    top_B1 = torch.tensor([[top_bin_size(n, top_frac)] for n in n_valid_B1.flatten().tolist()],
                          dtype=torch.long, device=n_valid_B1.device).view_as(n_valid_B1)
    rest_B1 = (n_valid_B1 - top_B1).clamp(min=1)
    # ranks top, ..., n-1 split evenly into bins 1..num_bins-1: bin = 1 + floor((rank - top) * (bins - 1) / rest)
    bin_BT = 1 + ((rank_BT - top_B1) * (num_bins - 1)).div(rest_B1, rounding_mode="floor")
    bin_BT = torch.where(rank_BT < top_B1, 0, bin_BT)
    return torch.where(valid, bin_BT.long(), -1)


# ----------------------------------------------------------------------------- aggregation

def resolve_aggregation(loss_type: str, aggregation: str | None) -> str:
    """The aggregation `policy_loss` uses: `aggregation`, or the loss's paper default if None.

    Raises ValueError on an unknown loss_type or aggregation, or the ESPO bin mean for a
    loss without entropy bins.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"type={loss_type!r}: need one of {', '.join(map(repr, LOSS_TYPES))}")
    agg = PAPER_AGGREGATION[loss_type] if aggregation is None else aggregation
    if agg not in AGGREGATIONS:
        raise ValueError(f"aggregation={agg!r}: need one of {', '.join(map(repr, AGGREGATIONS))}")
    if agg == "seq-mean-bin-mean-token-mean" and loss_type != "espo":
        raise ValueError(f"aggregation={agg!r}: ESPO's entropy bins; only with type='espo' (type={loss_type!r})")
    return agg


def aggregate(obj_BT: torch.Tensor, mask_BT: torch.Tensor, *, aggregation: str, normalizer: float | None = None,
              bin_BT: torch.Tensor | None = None, num_bins: int = 1) -> torch.Tensor:
    """Scalar mean of the per-token objective [B, T] over the valid tokens, as `aggregation` names.

    normalizer replaces this batch's own count in the outermost mean (tokens for
    token-mean, sequences otherwise), so micro-batches of one optimizer step add up to the
    step's mean. seq-mean-token-sum-norm (Dr.GRPO) divides the sum over every token by a
    constant, sequences x the generation budget, which only the caller knows: the normalizer,
    required there. bin_BT (from `entropy_bins`) and num_bins serve the ESPO bin mean.
    Raises ValueError when seq-mean-token-sum-norm lacks its normalizer.
    """
    if aggregation == "token-mean":  # every token of the batch weighs the same: long sequences weigh more (DAPO)
        return (obj_BT * mask_BT).sum() / (normalizer if normalizer is not None else mask_BT.sum().clamp(min=1))
    if aggregation == "seq-mean-token-sum-norm":  # sum_i sum_t / (G * max_tokens): Dr.GRPO's constant normaliser
        if normalizer is None or normalizer <= 0:
            raise ValueError(f"aggregation='seq-mean-token-sum-norm' needs normalizer = sequences x max_tokens (the "
                             f"generation budget) > 0, got {normalizer}")
        return (obj_BT * mask_BT).sum() / normalizer
    num_seqs = normalizer if normalizer is not None else obj_BT.shape[0]
    if aggregation == "seq-mean-bin-mean-token-mean":
        assert bin_BT is not None, "the ESPO bin mean needs bin_BT"
        idx_BT = bin_BT.clamp(min=0)  # padding parked in bin 0 with zero weight
        zeros_BQ = obj_BT.new_zeros(obj_BT.shape[0], num_bins)
        count_BQ = zeros_BQ.scatter_add(1, idx_BT, mask_BT)  # (B, Q) tokens per bin
        bin_obj_BQ = zeros_BQ.scatter_add(1, idx_BT, obj_BT * mask_BT) / count_BQ.clamp(min=1)  # mean within a bin
        nonempty_BQ = (count_BQ > 0).to(mask_BT.dtype)
        # mean over a sequence's non-empty bins: a short sequence may fill fewer bins than num_bins (reading 3)
        seq_obj_B = (bin_obj_BQ * nonempty_BQ).sum(-1) / nonempty_BQ.sum(-1).clamp(min=1)
        return seq_obj_B.sum() / num_seqs
    seq_sum_B = (obj_BT * mask_BT).sum(-1)
    if aggregation == "seq-mean-token-mean":
        return (seq_sum_B / mask_BT.sum(-1).clamp(min=1)).sum() / num_seqs
    if aggregation == "seq-mean-token-sum":
        return seq_sum_B.sum() / num_seqs
    raise ValueError(f"aggregation={aggregation!r}; valid: {', '.join(AGGREGATIONS)}")


# ----------------------------------------------------------------------------- per-token objectives
# Inputs: logp_BT [B, T] log pi_theta (grad flows), log_w_BT [B, T] log pi_theta - log pi_old
# (0 on padding), mask_BT [B, T] 1 on completion tokens, adv_B1 [B, 1] sequence advantages (or
# [B, T] token advantages, for the token-level objectives only), all
# one float dtype. Each returns obj_BT [B, T], the objective to maximise per token (any value on
# padding: the aggregation masks it), the ratio it clips [B, T] (detached, for metrics), and
# bool [B, T] masks of the tokens clipped on the low and on the high side.

def token_clip_objective(log_w_BT, adv_B1, *, eps_low: float, eps_high: float):
    """GRPO/DAPO: min(w A, clip(w, 1 - eps_low, 1 + eps_high) A) (arXiv 2503.14476 eq. 8)."""
    # the min takes the clipped branch only where it is the pessimistic one: w above 1 + eps_high with
    # A > 0, or below 1 - eps_low with A < 0; there the gradient is zero
    ratio_BT = log_w_BT.exp()
    clipped_BT = ratio_BT.clamp(1 - eps_low, 1 + eps_high)
    obj_BT = torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
    return obj_BT, ratio_BT.detach(), (ratio_BT < 1 - eps_low) & (adv_B1 < 0), (ratio_BT > 1 + eps_high) & (adv_B1 > 0)


def gspo_objective(logp_BT, log_w_BT, mask_BT, adv_B1, *, eps_low: float, eps_high: float, token_level: bool):
    """GSPO (arXiv 2507.18071 eq. 5, 7) or, if token_level, GSPO-token (eq. 13-14)."""
    # log s_i = mean_t log w_t: the length-normalised sequence ratio (log_w is 0 on padding)
    log_s_B1 = log_w_BT.sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1)
    if token_level:  # value s_i on every token, gradient s_i * grad log pi_theta(y_t)
        s_BT = (log_s_B1.detach() + logp_BT - logp_BT.detach()).exp()
    else:
        s_BT = log_s_B1.exp().expand_as(logp_BT)
    obj_BT = torch.minimum(s_BT * adv_B1, s_BT.clamp(1 - eps_low, 1 + eps_high) * adv_B1)
    return obj_BT, s_BT.detach(), (s_BT < 1 - eps_low) & (adv_B1 < 0), (s_BT > 1 + eps_high) & (adv_B1 > 0)


def gmpo_objective(log_w_BT, mask_BT, adv_B1, *, eps_low: float, eps_high: float):
    """GMPO (arXiv 2507.20673 sec. 3): A * geometric mean of the token-clipped ratios, clip in log space."""
    sign_B1 = adv_B1.sign()
    # sgn(A) min(sgn(A) log w, sgn(A) clip(log w)): the min branch for A > 0, the max for A < 0
    log_term_BT = sign_B1 * torch.minimum(sign_B1 * log_w_BT, sign_B1 * log_w_BT.clamp(-eps_low, eps_high))
    log_g_B1 = (log_term_BT * mask_BT).sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1)
    obj_BT = (adv_B1 * log_g_B1.exp()).expand_as(log_w_BT)
    return obj_BT, log_w_BT.detach().exp(), (log_w_BT < -eps_low) & (adv_B1 < 0), (log_w_BT > eps_high) & (adv_B1 > 0)


def cispo_objective(logp_BT, log_w_BT, adv_B1, *, eps_low: float, eps_high: float):
    """CISPO (arXiv 2506.13585 eq. 4-5): sg[clip(w, 1 - eps_low, 1 + eps_high)] A log pi_theta."""
    ratio_BT = log_w_BT.detach().exp()
    # the clipped weight is a constant (detached): it scales the REINFORCE term A log pi, never zeroes it
    obj_BT = ratio_BT.clamp(1 - eps_low, 1 + eps_high) * adv_B1 * logp_BT
    return obj_BT, ratio_BT, ratio_BT < 1 - eps_low, ratio_BT > 1 + eps_high


def espo_objective(logp_BT, log_w_BT, mask_BT, adv_B1, entropy_BT, bin_BT, *, alpha: float, vocab_size: int,
                   num_bins: int):
    """ESPO (arXiv 2512.00499): GSPO-token form with a ratio and a clip range per entropy bin.

    Also returns the tokens [B, Q] and clip eps [B, Q] of each sequence's bins.
    """
    idx_BT = bin_BT.clamp(min=0)  # padding parked in bin 0 with zero weight
    zeros_BQ = logp_BT.new_zeros(logp_BT.shape[0], num_bins)
    count_BQ = zeros_BQ.scatter_add(1, idx_BT, mask_BT)
    safe_BQ = count_BQ.clamp(min=1)
    mean_logw_BQ = zeros_BQ.scatter_add(1, idx_BT, log_w_BT.detach()) / safe_BQ  # (B, Q) log s_tau per bin
    mean_ent_BQ = zeros_BQ.scatter_add(1, idx_BT, entropy_BT.detach().to(mask_BT.dtype) * mask_BT) / safe_BQ
    # eps_tau = alpha * mean entropy / log|V|: uncertain tokens get a wider trust region (log|V| is the most entropy)
    eps_BQ = alpha * mean_ent_BQ / math.log(vocab_size)
    # GSPO-token form: value s_tau, gradient s_tau * grad log pi_theta(y_t)
    s_BT = (mean_logw_BQ.gather(1, idx_BT) + logp_BT - logp_BT.detach()).exp()
    eps_BT = eps_BQ.gather(1, idx_BT)  # (B, T) each token's bin's clip range
    # clip(s, 1 - eps, 1 + eps) elementwise; torch.clamp, as the other losses, so a tie passes the whole
    # gradient (reading 12), where a maximum of a minimum would split it at each bound it touches
    obj_BT = torch.minimum(s_BT * adv_B1, s_BT.clamp(1 - eps_BT, 1 + eps_BT) * adv_B1)
    low_BT, high_BT = (s_BT < 1 - eps_BT) & (adv_B1 < 0), (s_BT > 1 + eps_BT) & (adv_B1 > 0)
    return obj_BT, s_BT.detach(), low_BT, high_BT, count_BQ, eps_BQ


# ----------------------------------------------------------------------------- penalties and corrections

def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
               estimator: str) -> torch.Tensor:
    """Per-token estimate [B, T] of KL(pi_theta || pi_ref), grad through logp; 0 on padding.

    k1 = log pi_theta - log pi_ref; k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1, always >= 0
    (GRPO arXiv 2402.03300 eq. 4; Schulman 2020). Raises ValueError on an unknown estimator.
    """
    log_r_BT = (ref_logp_BT.detach() - logp_BT) * mask_BT  # log(pi_ref / pi_theta)
    # samples come from pi_old, not pi_theta; near pi_theta = pi_old both estimate the KL (reading 10)
    if estimator == "k1":
        return -log_r_BT
    if estimator == "k3":
        return log_r_BT.exp() - log_r_BT - 1
    raise ValueError(f"kl_estimator={estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def mismatch_weights(old_logp_BT: torch.Tensor, infer_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                     tis_cap: float | None = None, icepop_bounds: tuple[float, float] | None = None):
    """Constant per-token weight [B, T] correcting for the engine's sampling policy, and metrics.

    k = pi_old / pi_infer per token. TIS: min(k, tis_cap) (Yao et al. 2025); IcePop:
    k inside [a, b], 0 outside (arXiv 2510.18855 sec. 4). Exactly one is given: tis_cap > 0 and
    0 <= a < b, LossConfig's rules.
    """
    assert (tis_cap is None) != (icepop_bounds is None), "exactly one of tis_cap and icepop_bounds"
    # k = pi_old / pi_infer: how much more likely the trainer finds the engine's sample than the engine did
    log_k_BT = (old_logp_BT.detach() - infer_logp_BT.detach().to(old_logp_BT.dtype)) * mask_BT
    k_BT = log_k_BT.exp()
    n_tok = mask_BT.sum().clamp(min=1)
    if tis_cap is not None:
        weight_BT = k_BT.clamp(max=tis_cap)
        metrics = {"mismatch/tis_truncated_frac": float(((k_BT > tis_cap) * mask_BT).sum() / n_tok)}
    else:
        lo, hi = icepop_bounds
        inside_BT = (k_BT >= lo) & (k_BT <= hi)
        weight_BT = k_BT * inside_BT
        metrics = {"mismatch/icepop_masked_frac": float((~inside_BT * mask_BT).sum() / n_tok)}
    metrics["mismatch/is_weight_mean"] = float((weight_BT * mask_BT).sum() / n_tok)
    return weight_BT, metrics


def mismatch_metrics(infer_logp: list[torch.Tensor], trainer_logp: list[torch.Tensor], *,
                     infer_routes: list[torch.Tensor] | None = None,
                     trainer_routes: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Train-inference mismatch of one batch, on the engine's own samples, in float64.

    infer_logp / trainer_logp: per sequence, log pi(token) [C_i] of the sampled tokens
    under the engine and under the trainer (pi_old, in a run). With d = log pi_infer - log pi_trainer:
    mismatch/kl is the k3 estimate of KL(pi_infer || pi_trainer), mean(exp(-d) - 1 + d)
    (unbiased and non-negative for samples from pi_infer; Schulman 2020, "Approximating
    KL Divergence"), mismatch/kl_k1 the plain mean(d), mismatch/max_abs_logp and
    mismatch/mean_abs_logp over tokens. infer_routes / trainer_routes: per sequence
    [T_i, L, K] expert ids; mismatch/route_diff/layer{l} is the fraction of tokens whose
    expert set in MoE layer l differs (order within the top-k ignored, rows with -1
    skipped), mismatch/route_diff its mean over layers.
    """
    d = torch.cat([a.double().flatten() - b.double().flatten().to(a.device) for a, b in zip(infer_logp, trainer_logp)]
                  or [torch.zeros(0, dtype=torch.float64)])
    if d.numel() == 0:  # nothing sampled: no gap to report
        d = torch.zeros(1, dtype=torch.float64)
    m = {"mismatch/kl": (torch.exp(-d) - 1 + d).mean().item(), "mismatch/kl_k1": d.mean().item(),
         "mismatch/max_abs_logp": d.abs().max().item(), "mismatch/mean_abs_logp": d.abs().mean().item()}
    if infer_routes is not None and trainer_routes is not None:
        a = torch.cat([r.long() for r in infer_routes]).sort(dim=-1).values  # (N, L, K)
        b = torch.cat([r.long().to(a.device) for r in trainer_routes]).sort(dim=-1).values
        valid_N = ((a >= 0) & (b >= 0)).all(-1).all(-1)
        diff_L = (a[valid_N] != b[valid_N]).any(-1).double().mean(0)
        m.update({f"mismatch/route_diff/layer{l}": v for l, v in enumerate(diff_L.tolist())})
        m["mismatch/route_diff"] = diff_L.mean().item()
    return m


# ----------------------------------------------------------------------------- the loss

@dataclass(frozen=True)
class LossConfig:
    """The policy loss and its advantages: the run's `loss` section, checked when built. aggregation and
    the clip eps None take the loss's paper value (`aggregation_name`, `clip_eps`). Raises ValueError on a
    field its rule refuses (`RULES`), ESPO's bin mean for another loss, or TIS and IcePop at once."""
    type: str = "espo"
    """'espo', 'grpo' (DAPO token clip), 'drgrpo', 'gspo', 'gspo-token', 'gmpo' or 'cispo' (the module docstring)."""
    aggregation: str | None = None
    """'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm' or (ESPO only)
    'seq-mean-bin-mean-token-mean'; None = the loss's paper default (PAPER_AGGREGATION)."""
    clip_eps_low: float | None = None
    """Lower clip epsilon of the non-ESPO losses; None = the loss's paper value (PAPER_CLIP_EPS, DAPO's 0.2)."""
    clip_eps_high: float | None = None
    """Upper clip epsilon; None = the loss's paper value (DAPO's clip-higher 0.28, GSPO's 4e-4)."""
    espo_alpha: float = 0.02
    """ESPO clip scale: eps_tau = alpha * mean entropy / log|V| (arXiv 2512.00499)."""
    espo_top_frac: float = 0.2
    """Fraction of highest-entropy tokens in ESPO's first entropy bin."""
    espo_num_bins: int = 2
    """ESPO entropy bins per sequence (the paper's "entropy groups"): the top fraction, then the rest split evenly."""
    kl_coef: float = 0.0
    """KL-to-reference penalty weight (reference = a frozen copy of the policy as RL starts, sharded as the policy
    is on several ranks); 0 = none, no reference kept."""
    kl_estimator: str = "k3"
    """'k1' or 'k3' (Schulman's estimators)."""
    tis_cap: float | None = None
    """TIS cap C on pi_old/pi_infer per token (2.0 in Yao et al.); None = off."""
    icepop: tuple[float, float] | None = None
    """IcePop bounds (a, b) on pi_old/pi_infer, a token outside them masked ((0.5, 5.0) in Ring-1T); None = off.
    On the command line: loss.icepop=0.5,5."""
    adv_scale_by_std: bool = True
    """Divide advantages by the reward std (GRPO); false for Dr.GRPO."""
    adv_std_over: str = "group"
    """With adv_scale_by_std: the std of each group's rewards ('group') or of the whole batch's ('batch')."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "type": one_of(*LOSS_TYPES),
        "aggregation": optional(one_of(*AGGREGATIONS), "the loss's paper default"),
        "clip_eps_low": optional(number(0), "the loss's paper value"),
        "clip_eps_high": optional(number(0), "the loss's paper value"),
        "espo_alpha": POSITIVE,
        "espo_top_frac": number(0, 1, low_open=True),
        "espo_num_bins": integer(1),
        "kl_coef": number(0, why="a weight on a penalty; a negative one would reward drifting from the reference"),
        "kl_estimator": one_of(*KL_ESTIMATORS),
        "tis_cap": optional(POSITIVE, "off"),
        "icepop": optional(pair(NON_NEGATIVE, "two numbers 0 <= a < b, e.g. (0.5, 5.0)", lambda v: v[0] < v[1]),
                           "off"),
        "adv_scale_by_std": FLAG,
        "adv_std_over": one_of("group", "batch"),
    }

    def __post_init__(self):
        check_fields(self)
        resolve_aggregation(self.type, self.aggregation)  # ESPO's bin mean on another loss
        if self.tis_cap is not None and self.icepop is not None:
            raise ValueError(f"tis_cap={self.tis_cap}: None (off) when icepop={self.icepop} is set; one mismatch "
                             f"correction at a time")
        if self.icepop is not None:  # a config file may give a list; one spelling from here on
            object.__setattr__(self, "icepop", tuple(float(x) for x in self.icepop))

    @property
    def aggregation_name(self) -> str:
        """The aggregation in use: `aggregation`, or the loss's paper default."""
        return resolve_aggregation(self.type, self.aggregation)

    @property
    def clip_eps(self) -> tuple[float, float]:
        """(eps_low, eps_high) in use: each set one, else the loss's paper value (ESPO's clip comes from entropy)."""
        low, high = PAPER_CLIP_EPS.get(self.type, (0.0, 0.0))
        return (low if self.clip_eps_low is None else self.clip_eps_low,
                high if self.clip_eps_high is None else self.clip_eps_high)


def objective(logp_BT, log_w_BT, mask_BT, adv_B1, cfg: LossConfig, old_entropy_BT=None, vocab_size=None):
    """cfg.type's per-token objective (the dispatch over the objectives above): obj_BT, the ratio it
    clips, the low/high clip masks, ESPO's entropy bins (None for the others) and ESPO's bin metrics."""
    loss_type, (eps_low, eps_high) = cfg.type, cfg.clip_eps
    metrics, bin_BT = {}, None
    if loss_type in ("grpo", "drgrpo"):
        obj_BT, ratio_BT, low_BT, high_BT = token_clip_objective(log_w_BT, adv_B1, eps_low=eps_low, eps_high=eps_high)
    elif loss_type in ("gspo", "gspo-token"):
        obj_BT, ratio_BT, low_BT, high_BT = gspo_objective(logp_BT, log_w_BT, mask_BT, adv_B1, eps_low=eps_low,
                                                           eps_high=eps_high, token_level=loss_type == "gspo-token")
    elif loss_type == "gmpo":
        obj_BT, ratio_BT, low_BT, high_BT = gmpo_objective(log_w_BT, mask_BT, adv_B1, eps_low=eps_low,
                                                           eps_high=eps_high)
    elif loss_type == "cispo":
        obj_BT, ratio_BT, low_BT, high_BT = cispo_objective(logp_BT, log_w_BT, adv_B1, eps_low=eps_low,
                                                            eps_high=eps_high)
    else:  # espo
        if old_entropy_BT is None:
            raise ValueError("loss type 'espo' needs old_entropy_BT (pi_old's entropy per token)")
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"loss type 'espo' needs vocab_size >= 2 (|V| in its clip range), got {vocab_size}")
        bin_BT = entropy_bins(old_entropy_BT, mask_BT, top_frac=cfg.espo_top_frac, num_bins=cfg.espo_num_bins)
        obj_BT, ratio_BT, low_BT, high_BT, count_BQ, eps_BQ = espo_objective(
            logp_BT, log_w_BT, mask_BT, adv_B1, old_entropy_BT, bin_BT, alpha=cfg.espo_alpha, vocab_size=vocab_size,
            num_bins=cfg.espo_num_bins)
        for q in range(cfg.espo_num_bins):
            nonempty_B = count_BQ[:, q] > 0
            metrics[f"espo/bin{q}_tokens"] = float(count_BQ[:, q].sum())
            metrics[f"espo/bin{q}_clip_eps"] = float((eps_BQ[:, q] * nonempty_B).sum() / nonempty_B.sum().clamp(min=1))
    return obj_BT, ratio_BT, low_BT, high_BT, bin_BT, metrics


def policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_B: torch.Tensor, mask_BT: torch.Tensor,
                cfg: LossConfig, *, vocab_size: int | None = None, old_entropy_BT: torch.Tensor | None = None,
                ref_logp_BT: torch.Tensor | None = None, infer_logp_BT: torch.Tensor | None = None,
                normalizer: float | None = None):
    """Policy-gradient loss (a scalar to minimise) and a dict of float metrics.

    logp_BT: log pi_theta of each target token (grad flows), [B, T] fp32 or fp64; the mask selects the completion.
    old_logp_BT: log pi_old of the same tokens, [B, T]; treated as constant.
    adv_B: one advantage per sequence, [B], or one per token, [B, T] (RL-ZVP, arXiv 2509.21880).
    mask_BT: 1 on completion tokens, 0 on padding; what the other inputs hold where it is 0 never reaches
    the loss or its gradient, NaN and inf included.
    cfg: the loss (module docstring): ESPO splits tokens into cfg.espo_num_bins entropy
    bins, the first holding the espo_top_frac highest-entropy tokens, clip
    eps_tau = espo_alpha * mean e / log|V|; the other losses clip at cfg.clip_eps_low/high
    (GMPO: in log space; CISPO: of the IS weight).
    vocab_size: |V| of the model's vocabulary, in ESPO's clip range (ESPO only).
    old_entropy_BT: [B, T] nats under pi_old (ESPO only).
    ref_logp_BT: the reference policy's logprobs when cfg.kl_coef != 0 (see `kl_penalty`).
    infer_logp_BT: the engine's logprobs [B, T] aligned with the mask, for cfg.tis_cap or
    cfg.icepop (see `mismatch_weights`).
    normalizer: divide by this (tokens for token-mean, sequences otherwise; sequences x the
    generation budget for Dr.GRPO's seq-mean-token-sum-norm, which needs it) instead of this
    batch's own count, so micro-batches of one optimizer step add up to the step's mean.
    Metrics: clip_frac_low/high (valid tokens on the clipped side), ratio_mean/min/max (of
    the ratio the loss clips), approx_kl (k3 of KL(pi_old || pi_theta)), kl_ref,
    espo/bin{q}_tokens and espo/bin{q}_clip_eps, and the mismatch weights'.
    Raises ValueError on a missing input the config needs, or token advantages with gmpo.
    """
    mask = mask_BT.to(logp_BT.dtype)
    # Padding may hold anything, NaN and inf too: every input is set to 0 there by selection, never by a
    # product with the mask (NaN * 0 is NaN), and torch.where sends a zero gradient to what it drops.
    valid = mask_BT.bool()
    logp_BT, old_entropy_BT, ref_logp_BT, infer_logp_BT = (
        None if x is None else torch.where(valid, x, 0.0)
        for x in (logp_BT, old_entropy_BT, ref_logp_BT, infer_logp_BT))
    old = torch.where(valid, old_logp_BT.detach(), 0.0)
    adv = adv_B.detach().to(logp_BT.dtype)
    adv = torch.where(valid, adv, 0.0) if adv.dim() == 2 else adv  # token advantages [B, T]
    if adv.dim() == 2 and cfg.type == "gmpo":
        raise ValueError("token advantages [B, T] need a token-level loss; loss type 'gmpo' takes one per sequence")
    adv_B1 = adv[:, None] if adv.dim() == 1 else adv  # [B, 1], or [B, T] token advantages
    log_w_BT = (logp_BT - old) * mask  # (B, T) log token ratio, 0 on padding (so padding never clips)
    obj_BT, ratio_BT, low_BT, high_BT, bin_BT, metrics = objective(logp_BT, log_w_BT, mask, adv_B1, cfg,
                                                                   old_entropy_BT, vocab_size)
    if cfg.tis_cap is not None or cfg.icepop is not None:
        if infer_logp_BT is None:
            raise ValueError("tis_cap / icepop need infer_logp_BT (the engine's logprobs)")
        weight_BT, mismatch = mismatch_weights(old, infer_logp_BT, mask, tis_cap=cfg.tis_cap, icepop_bounds=cfg.icepop)
        obj_BT = obj_BT * weight_BT  # the policy term only, not the KL term (reading 8)
        metrics.update(mismatch)
    n_tok = mask.sum().clamp(min=1)
    if cfg.kl_coef != 0.0:
        if ref_logp_BT is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp_BT (the reference policy's logprobs)")
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, mask, estimator=cfg.kl_estimator)
        obj_BT = obj_BT - cfg.kl_coef * kl_BT
        metrics["kl_ref"] = float((kl_BT.detach() * mask).sum() / n_tok)
    loss = -aggregate(obj_BT, mask, aggregation=cfg.aggregation_name, normalizer=normalizer, bin_BT=bin_BT,
                      num_bins=cfg.espo_num_bins)
    with torch.no_grad():
        r = ratio_BT[mask.bool()]
        log_w = log_w_BT.detach()
        metrics.update({
            "clip_frac_low": float((low_BT * mask).sum() / n_tok),
            "clip_frac_high": float((high_BT * mask).sum() / n_tok),
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_min": float(r.min()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
            # k3 estimator of KL(pi_old || pi_theta) per token (Schulman 2020, "Approximating KL divergence")
            "approx_kl": float(((log_w.exp() - 1 - log_w) * mask).sum() / n_tok),
        })
    return loss, metrics
