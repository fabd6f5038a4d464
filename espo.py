"""Policy losses and advantages as pure functions: ESPO, with a plain GRPO token-clip mode.

Group-relative advantage (GRPO, arXiv 2402.03300 sec. 4.1.2): for the G rollouts of one
prompt with rewards r_1..r_G, A_i = (r_i - mean(r)) / (std(r) + eps), or without the std
(Dr.GRPO, arXiv 2503.20783).

GRPO / DAPO token clip (arXiv 2402.03300 eq. 3; DAPO arXiv 2503.14476 eq. 8-10): token
ratio w_t = pi_theta(y_t) / pi_old(y_t); per token min(w_t A, clip(w_t, 1 - eps_low,
1 + eps_high) A), averaged over all tokens of the batch (DAPO's token-mean) or per
sequence then over sequences (seq-mean-token-mean, the GRPO paper's form).

ESPO (arXiv 2512.00499): the tokens of each sequence are split by their entropy under
the old policy, e_t = -sum_v pi_old(v) log pi_old(v), into entropy groups (default two:
the top 20 percent highest-entropy tokens, and the rest; groups need not be contiguous).
Each group tau has a length-normalised ratio s_tau = exp(mean_{t in tau} log w_t), used in
the GSPO-token stop-gradient form s_t = sg[s_tau] * pi_theta(y_t) / sg[pi_theta(y_t)]
(GSPO, arXiv 2507.18071 eq. 13), and its own symmetric clip range
eps_tau = alpha * mean_{t in tau} e_t / log|V| (alpha = 0.02). The objective is the mean
over tokens in a group, then over the non-empty groups of a sequence, then over
sequences, of min(s_t A, clip(s_t, 1 - eps_tau, 1 + eps_tau) A). The loss is its negative.

Readings chosen where the printed ESPO paper is ambiguous:
1. Token-ratio denominator: pi_old is the trainer's own recomputation of the rollout
   policy (a no-grad forward with the engine's routes replayed), not the engine's
   logprobs; those only feed train-inference mismatch metrics.
2. Advantage mask: every completion token of a sequence carries that sequence's A_i in
   every entropy group; only padding (mask 0) is excluded. No token is dropped for low
   entropy; low-entropy tokens form their own group with a tighter clip.
3. Group sizes: the top group takes ceil(top_frac * n_valid) tokens (at least one), the
   remaining ranks split evenly into num_groups - 1 groups; empty groups are skipped in
   the mean over groups. Ties in entropy are broken by position (stable sort).
4. |V| in eps_tau is the model's full vocabulary size (the maximum possible entropy is log|V|).

Legend: B sequences, T completion tokens (padded), G rollouts per prompt, P prompts,
Q entropy groups.
"""

from __future__ import annotations

import math

import torch


def group_advantages(rewards_PG: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A [P, G] fp32 = (r - mean_g r) / (std_g r + eps); without the std if scale_by_std is False.

    std is the unbiased sample std, as in the GRPO reference code. A group whose rewards are
    all equal gets all-zero advantages. Raises ValueError unless rewards are 2-D with G >= 2.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards must be [P, G] with G >= 2, got shape {tuple(rewards_PG.shape)}")
    r = rewards_PG.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv


def _aggregate(obj_BT, mask_BT, aggregation: str, normalizer: float | None):
    """Mean of the per-token objective over tokens (token-mean) or tokens then sequences."""
    if aggregation == "token-mean":
        return (obj_BT * mask_BT).sum() / (normalizer if normalizer is not None else mask_BT.sum().clamp(min=1))
    if aggregation == "seq-mean-token-mean":
        per_seq = (obj_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return per_seq.sum() / (normalizer if normalizer is not None else obj_BT.shape[0])
    raise ValueError(f"aggregation={aggregation!r}; valid: 'token-mean', 'seq-mean-token-mean'")


def entropy_groups(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, *, top_frac: float, num_groups: int) -> torch.Tensor:
    """Entropy-group index [B, T] int64 per token (0 = highest entropy); -1 on padding.

    Group 0 holds the ceil(top_frac * n_valid) highest-entropy valid tokens of each
    sequence; the rest of the ranks are split evenly into num_groups - 1 groups.
    """
    if num_groups < 1 or not 0.0 < top_frac <= 1.0:
        raise ValueError(f"need num_groups >= 1 and top_frac in (0, 1]; got {num_groups}, {top_frac}")
    valid = mask_BT.bool()
    n_valid_B1 = valid.sum(-1, keepdim=True)
    if num_groups == 1:
        return torch.where(valid, 0, -1)
    # rank 0 = highest entropy; padding sorts last
    order = entropy_BT.masked_fill(~valid, -math.inf).argsort(dim=-1, descending=True, stable=True)
    rank_BT = order.argsort(dim=-1)  # (B, T) inverse permutation: each token's rank
    top_B1 = (n_valid_B1 * top_frac).ceil().clamp(min=1)
    rest_B1 = (n_valid_B1 - top_B1).clamp(min=1)
    group = 1 + ((rank_BT - top_B1) * (num_groups - 1)).div(rest_B1, rounding_mode="floor")
    group = torch.where(rank_BT < top_B1, 0, group)
    return torch.where(valid, group.long(), -1)


def policy_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_B: torch.Tensor, mask_BT: torch.Tensor, *,
                loss_type: str = "espo", old_entropy_BT: torch.Tensor | None = None, vocab_size: int | None = None,
                espo_alpha: float = 0.02, espo_top_frac: float = 0.2, espo_num_groups: int = 2,
                clip_eps_low: float = 0.2, clip_eps_high: float = 0.28, aggregation: str = "token-mean",
                normalizer: float | None = None):
    """Policy-gradient loss (a scalar to minimise) and a dict of float metrics.

    logp_BT: log pi_theta of the completion tokens (grad flows), [B, T] fp32.
    old_logp_BT: log pi_old of the same tokens, [B, T]; treated as constant.
    adv_B: one advantage per sequence, [B], or one per token, [B, T]. mask_BT: 1 on completion tokens, 0 on padding.
    loss_type "espo" needs old_entropy_BT ([B, T] nats) and vocab_size; it aggregates
    token -> entropy group -> sequence -> batch (ESPO, arXiv 2512.00499) and ignores
    `aggregation`. loss_type "grpo" is the token clip with eps_low/eps_high (DAPO,
    arXiv 2503.14476 eq. 10) aggregated per `aggregation`.
    normalizer: divide the summed objective by this (sequences for seq-level means,
    tokens for token-mean) instead of this batch's own count, so micro-batches of one
    optimizer step add up to the step's mean.
    Raises ValueError on an unknown loss_type/aggregation or missing ESPO inputs.
    """
    mask = mask_BT.to(logp_BT.dtype)
    old = old_logp_BT.detach()
    adv = adv_B.detach().to(logp_BT.dtype)
    adv_B1 = adv[:, None] if adv.dim() == 1 else adv  # [B, 1], or [B, T] token advantages (RL-ZVP)
    log_w = (logp_BT - old) * mask  # (B, T) log token ratio, 0 on padding
    metrics = {}
    if loss_type == "grpo":
        ratio = log_w.exp()
        clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
        obj = torch.minimum(ratio * adv_B1, clipped * adv_B1)
        loss = -_aggregate(obj, mask, aggregation, normalizer)
        low = (ratio < 1 - clip_eps_low) & (adv_B1 < 0)
        high = (ratio > 1 + clip_eps_high) & (adv_B1 > 0)
    elif loss_type == "espo":
        if old_entropy_BT is None or vocab_size is None:
            raise ValueError("loss_type='espo' needs old_entropy_BT and vocab_size")
        group_BT = entropy_groups(old_entropy_BT, mask, top_frac=espo_top_frac, num_groups=espo_num_groups)
        Q = espo_num_groups
        idx = group_BT.clamp(min=0)  # padding parked in group 0 with zero weight
        zeros = torch.zeros(logp_BT.shape[0], Q, dtype=logp_BT.dtype, device=logp_BT.device)
        count_BQ = zeros.scatter_add(1, idx, mask)
        safe = count_BQ.clamp(min=1)
        mean_logw_BQ = zeros.scatter_add(1, idx, log_w.detach()) / safe
        eps_BQ = espo_alpha * (zeros.scatter_add(1, idx, old_entropy_BT.detach().to(mask.dtype) * mask) / safe) / math.log(vocab_size)
        # GSPO-token form: value s_tau, gradient s_tau * grad log pi_theta(y_t)
        log_s = mean_logw_BQ.gather(1, idx) + logp_BT - logp_BT.detach()
        s = log_s.exp()
        eps = eps_BQ.gather(1, idx)
        obj = torch.minimum(s * adv_B1, torch.maximum(torch.minimum(s, 1 + eps), 1 - eps) * adv_B1) * mask
        group_obj_BQ = zeros.scatter_add(1, idx, obj) / safe
        nonempty_BQ = (count_BQ > 0).to(mask.dtype)
        seq_obj_B = (group_obj_BQ * nonempty_BQ).sum(-1) / nonempty_BQ.sum(-1).clamp(min=1)
        loss = -seq_obj_B.sum() / (normalizer if normalizer is not None else logp_BT.shape[0])
        ratio = s.detach()
        low = (s < 1 - eps) & (adv_B1 < 0)
        high = (s > 1 + eps) & (adv_B1 > 0)
        metrics["espo/top_group_tokens"] = float(count_BQ[:, 0].sum())
        metrics["espo/clip_eps_top"] = float((eps_BQ[:, 0] * (count_BQ[:, 0] > 0)).sum() / (count_BQ[:, 0] > 0).sum().clamp(min=1))
    else:
        raise ValueError(f"loss_type={loss_type!r}; valid: 'espo', 'grpo'")
    n_tok = mask.sum().clamp(min=1)
    with torch.no_grad():
        r = ratio[mask.bool()]
        metrics.update({
            "clip_frac_low": float((low * mask).sum() / n_tok),
            "clip_frac_high": float((high * mask).sum() / n_tok),
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_min": float(r.min()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
            # k3 estimator of KL(pi_old || pi_theta) per token (Schulman 2020, "Approximating KL divergence")
            "approx_kl": float(((log_w.detach().exp() - 1 - log_w.detach()) * mask).sum() / n_tok),
        })
    return loss, metrics
