"""Zero-variance prompt elimination (seed paper arXiv 2512.07710; DAPO arXiv 2503.14476 sec. 3.2).

A group whose G rewards are all equal has all-zero group-relative advantages, so its
rollouts carry no policy gradient and only dilute the batch. This file holds the
after-rollout stage: drop such groups and count what was dropped (the before- and
during-rollout stages, which save the generation itself, come with a later issue).

Legend: P prompts (groups), G rollouts per prompt.
"""

from __future__ import annotations

import torch


def post_rollout_filter(rewards_PG: torch.Tensor, lengths_PG: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Keep mask [P] bool (True = the group's rewards vary) and counts of what was dropped.

    rewards_PG: rewards of each prompt's G rollouts. lengths_PG: their completion lengths
    in tokens. Counts: groups, groups_dropped, all_correct / all_wrong (the dropped groups
    whose common reward is the batch max / anything else), rollouts_dropped,
    tokens_dropped (generated tokens spent on dropped groups), zero_variance_frac.
    Raises ValueError if the two shapes differ or are not 2-D.
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape != lengths_PG.shape:
        raise ValueError(f"rewards {tuple(rewards_PG.shape)} and lengths {tuple(lengths_PG.shape)} must be the same [P, G]")
    zero_var_P = (rewards_PG == rewards_PG[:, :1]).all(dim=1)
    keep_P = ~zero_var_P
    P, G = rewards_PG.shape
    top = rewards_PG.max() if rewards_PG.numel() else 0
    stats = {
        "groups": P,
        "groups_dropped": int(zero_var_P.sum()),
        "all_correct": int((zero_var_P & (rewards_PG[:, 0] == top) & (top > 0)).sum()),
        "rollouts_dropped": int(zero_var_P.sum()) * G,
        "tokens_dropped": int(lengths_PG[zero_var_P].sum()),
        "zero_variance_frac": float(zero_var_P.float().mean()) if P else 0.0,
    }
    stats["all_wrong"] = stats["groups_dropped"] - stats["all_correct"]
    return keep_P, stats
