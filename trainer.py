"""The trainer half of an RL step: rollouts as padded batches, pi_old, the policy update.

`train_on_rollouts` takes the kept rollouts of a step (`TrainBatch`: sequences, the
engine's routes and logprobs, advantages) and
  1. recomputes pi_old and its full-vocabulary entropy with the trainer's current weights,
     a no-grad forward with the engine's routes replayed (R3, arXiv 2510.11370), for every
     sequence but those of the first mini-batch: before the first optimizer step pi_old is
     pi_theta, so theirs come detached from the loss forward itself;
  2. adds RL-ZVP token advantages (arXiv 2509.21880) to the kept zero-variance groups;
  3. runs `num_minibatches` optimizer steps over a random split, each the gradient of one
     loss normalised over the whole mini-batch, accumulated over token-budget micro-batches
     (scheduler.pack_microbatches), the loss from espo.policy_loss;
  4. reports the train-inference mismatch (k3 KL of pi_infer against pi_old).

Several ranks: rank r trains members r, r + world, ... of each mini-batch; ranks with fewer
micro-batches run idle forwards so FSDP's collectives stay matched (distributed.py).

Legend: B sequences, T tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from config import TrainConfig
from distributed import all_gather_list, all_reduce_float, idle_forward, padded_microbatches, rank_world
from espo import policy_loss
from filter import zvp_token_advantages
from model import token_entropy, token_logprobs
from scheduler import pack_microbatches


def sequence_batch(seqs: list[list[int]], starts: list[int], pad_id: int, routes: list[torch.Tensor] | None = None,
                   num_layers: int = 0, top_k: int = 0):
    """Right-padded next-token batch from full sequences (prompt + completion).

    Returns inputs_BT, targets_BT (int64), mask_BT (1 where the target is a completion
    token: positions >= start - 1) and, if routes are given, routes_BTLK (-1 on padding).
    """
    B, T = len(seqs), max(len(s) for s in seqs) - 1
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    routes_BTLK = torch.full((B, T, num_layers, top_k), -1, dtype=torch.int32) if routes is not None else None
    for i, (s, start) in enumerate(zip(seqs, starts)):
        n = len(s) - 1
        inputs[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
        mask[i, start - 1:n] = 1.0
        if routes is not None:
            routes_BTLK[i, :n] = routes[i]
    return inputs, targets, mask, routes_BTLK


def pad_rows(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """1-D tensors stacked into [B, T], zero-padded on the right."""
    out = rows[0].new_zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def lr_at(step: int, peak: float, warmup: int, total: int, cosine: bool) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if not cosine:
        return peak
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine to 10% of peak


def optimizer_step(model, opt, cfg: TrainConfig, lr: float) -> float:
    for g in opt.param_groups:
        g["lr"] = lr
    if rank_world()[1] > 1:  # DTensor grads on two meshes (dense and expert): torchtitan's norm spans both
        from torchtitan.distributed.utils import clip_grad_norm_
        norm = clip_grad_norm_(list(model.parameters()), cfg.grad_clip, ep_enabled=cfg.ep > 1)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


@dataclass
class TrainBatch:
    """The kept rollouts of one RL step as trainer inputs (index i = one sequence)."""
    seqs: list[list[int]]  # prompt + completion ids
    starts: list[int]  # prompt lengths: the completion starts at seqs[i][starts[i]]
    routes: list[torch.Tensor]  # [len(seqs[i]) - 1, L, K] routed experts recorded by the engine
    adv_B: torch.Tensor  # one advantage per sequence
    infer_logp: list[torch.Tensor] | None = None  # [len(completion)] the engine's log pi_infer of each completion token
    adv_tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [len(seqs[i]) - 1] token advantages (RL-ZVP)

    def advantages(self, idx: list[int], T: int) -> torch.Tensor:
        """Advantages of sequences idx: [b] per sequence, or [b, T] per token when any of them has token advantages."""
        if not any(i in self.adv_tokens for i in idx):
            return self.adv_B[idx]
        adv_bT = self.adv_B[idx][:, None].repeat(1, T)
        for j, i in enumerate(idx):
            if i in self.adv_tokens:
                a = self.adv_tokens[i]
                adv_bT[j] = 0.0
                adv_bT[j, :len(a)] = a
        return adv_bT

    def micro(self, idx: list[int], cfg: TrainConfig, pad_id: int):
        """inputs, targets, loss mask [B, T] and routes to replay [B, T, L, K] (or None) for sequences idx."""
        inputs, targets, mask, routes = sequence_batch([self.seqs[i] for i in idx], [self.starts[i] for i in idx], pad_id,
                                                       [self.routes[i] for i in idx], cfg.model.num_moe_layers, cfg.model.top_k)
        dev = cfg.device
        return inputs.to(dev), targets.to(dev), mask.to(dev), (routes.to(dev) if cfg.router_replay else None)

    def engine_logp(self, idx: list[int], T: int) -> torch.Tensor:
        """The engine's logprobs of sequences idx, [B, T], where the loss mask is 1 (as in old_policy); 0 elsewhere."""
        rows = [torch.zeros(len(self.seqs[i]) - 1) for i in idx]
        for row, i in zip(rows, idx):
            row[self.starts[i] - 1:] = self.infer_logp[i]
        return pad_rows(rows, T)


def minibatches(num_seqs: int, cfg: TrainConfig, step: int) -> list[list[int]]:
    """The step's random split of sequence indices into num_minibatches mini-batches (one optimizer step each)."""
    perm = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(cfg.seed + step)).tolist()
    n_mb = min(cfg.num_minibatches, len(perm))
    return [perm[mb::n_mb] for mb in range(n_mb)]


@torch.no_grad()
def old_policy(model, batch: TrainBatch, cfg: TrainConfig, pad_id: int, seqs: list[int], old_logp: dict, old_ent: dict):
    """Fill old_logp / old_ent for sequences seqs (multi-rank: this rank's): log pi_old and the
    full-vocabulary entropy under pi_old, unpadded [len - 1], by a no-grad forward of the trainer's
    current weights."""
    micro = [[seqs[j] for j in idx] for idx in pack_microbatches([len(batch.seqs[i]) for i in seqs], cfg.microbatch_tokens)]
    for idx in (padded_microbatches(micro) if rank_world()[1] > 1 else micro):
        if not idx:
            idle_forward(model, cfg, backward=False)
            continue
        inputs, targets, _, routes = batch.micro(idx, cfg, pad_id)
        logits, _ = model(inputs, routed_experts=routes)
        store_old(batch, idx, token_logprobs(logits, targets, cfg.temperature), token_entropy(logits, cfg.temperature),
                  old_logp, old_ent)


def store_old(batch: TrainBatch, idx: list[int], logp_BT: torch.Tensor, ent_BT: torch.Tensor, old_logp: dict, old_ent: dict):
    for j, i in enumerate(idx):
        n = len(batch.seqs[i]) - 1  # unpadded: later micro-batches pad to their own width
        old_logp[i], old_ent[i] = logp_BT[j, :n].detach(), ent_BT[j, :n].detach()


def zvp_advantages(batch: TrainBatch, idx: list[int], zvp: dict[int, bool], old_ent: dict, cfg: TrainConfig):
    """RL-ZVP token advantages of the zero-variance-group sequences among idx, into batch.adv_tokens."""
    for i in idx:
        if i in zvp:
            n, s = len(batch.seqs[i]) - 1, batch.starts[i] - 1
            a = torch.zeros(n)
            a[s:] = zvp_token_advantages(old_ent[i][s:n].cpu(), correct=zvp[i], alpha=cfg.zvp_alpha)
            batch.adv_tokens[i] = a


def mismatch_metrics(batch: TrainBatch, old_logp: dict) -> dict:
    """Train-inference mismatch over the sequences in old_logp (all ranks): max |log pi_infer - log pi_old|
    and the k3 estimate of KL(pi_infer || pi_old) (Schulman 2020, "Approximating KL divergence") on the
    sampled completion tokens."""
    deltas = [batch.infer_logp[i] - lp[batch.starts[i] - 1:].cpu() for i, lp in old_logp.items()]
    d = torch.cat(deltas) if deltas else torch.zeros(0)
    if rank_world()[1] == 1:
        return {"mismatch/max_abs_logp": d.abs().max().item() if len(d) else 0.0,
                "mismatch/kl": (d.exp() - 1 - d).mean().item()}
    return {"mismatch/max_abs_logp": all_reduce_float(d.abs().max().item() if len(d) else 0.0, "max"),
            "mismatch/kl": all_reduce_float((d.exp() - 1 - d).sum().item()) / all_reduce_float(float(len(d)))}


def policy_update(model, opt, batch: TrainBatch, old_logp: dict, old_ent: dict, zvp: dict[int, bool], cfg: TrainConfig,
                  step: int, pad_id: int, ref_model=None) -> dict:
    """num_minibatches optimizer steps over a random split of the batch, each from packed micro-batches.

    old_logp / old_ent hold pi_old for every sequence but those of the first mini-batch: before
    the first optimizer step pi_old is the current policy, so those come from the same forward
    as the loss (detached), one no-grad forward fewer; their RL-ZVP advantages (zvp: sequence
    -> all correct) follow from that entropy. Both dicts are filled in for them here.
    ref_model: the frozen reference policy of the KL penalty (needed when cfg.kl_coef != 0).
    Multi-rank: rank r trains members r, r + world, ... of each mini-batch (old_logp and
    old_ent need only those); the normaliser counts the whole mini-batch and the loss is
    scaled by world (FSDP averages gradients), so the step equals the 1-process step.
    """
    rank, world = rank_world()
    losses, lmetrics, m = [], [], {}
    loss_cfg = cfg.loss_config()
    aggregation = loss_cfg.aggregation
    needs_infer = loss_cfg.tis_cap is not None or loss_cfg.icepop_bounds is not None
    for mb, members in enumerate(minibatches(len(batch.seqs), cfg, step)):
        # the loss of one optimizer step is a mean over the whole mini-batch, not per micro-batch
        normalizer = (sum(len(batch.seqs[i]) - batch.starts[i] for i in members) if aggregation == "token-mean"
                      else len(members))
        total = 0.0
        local = members[rank::world]
        micro = [[local[i] for i in idx] for idx in pack_microbatches([len(batch.seqs[i]) for i in local], cfg.microbatch_tokens)]
        for idx in (padded_microbatches(micro) if world > 1 else micro):
            if not idx:
                idle_forward(model, cfg, backward=True)
                if ref_model is not None:
                    idle_forward(ref_model, cfg, backward=False)  # its all-gathers too
                continue
            inputs, targets, mask, routes = batch.micro(idx, cfg, pad_id)
            T = inputs.shape[1]
            logits, _ = model(inputs, routed_experts=routes)
            logp = token_logprobs(logits, targets, cfg.temperature)
            if mb == 0:  # pi_old = pi_theta until the first optimizer step (detached: no graph is kept)
                store_old(batch, idx, logp, token_entropy(logits.detach(), cfg.temperature), old_logp, old_ent)
                zvp_advantages(batch, idx, zvp, old_ent, cfg)
            ref_logp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(ref_model(inputs, routed_experts=routes)[0], targets, cfg.temperature)
            loss, lm = policy_loss(
                logp, pad_rows([old_logp[i] for i in idx], T), batch.advantages(idx, T).to(cfg.device), mask, loss_cfg,
                old_entropy_BT=pad_rows([old_ent[i] for i in idx], T), ref_logp_BT=ref_logp,
                infer_logp_BT=batch.engine_logp(idx, T).to(cfg.device) if needs_infer else None, normalizer=normalizer)
            (loss * world if world > 1 else loss).backward()
            total += loss.item()
            lmetrics.append(lm)
        m["grad_norm"] = optimizer_step(model, opt, cfg, lr_at(step, cfg.lr, cfg.lr_warmup_steps, cfg.rl_steps, cosine=False))
        losses.append(all_reduce_float(total))
    lmetrics = all_gather_list(lmetrics)
    m["loss"] = sum(losses) / len(losses)
    m.update({f"loss/{k}": sum(x[k] for x in lmetrics) / len(lmetrics) for k in lmetrics[0]})
    return m


def train_on_rollouts(model, opt, batch: TrainBatch, zvp: dict[int, bool], cfg: TrainConfig, step: int, pad_id: int,
                      ref_model=None) -> dict:
    """The trainer half of an RL step: pi_old and its entropy recomputed by the trainer (so with stale
    rollouts the PPO ratio is taken against the current weights, and pi_infer / pi_old is what TIS or
    IcePop correct), RL-ZVP token advantages, then the policy update. Returns metrics.

    zvp: sequence index -> all correct, for the sequences of zero-variance groups kept for RL-ZVP."""
    rank, world = rank_world()
    parts = [members[rank::world] for members in minibatches(len(batch.seqs), cfg, step)]
    later = sorted(i for members in parts[1:] for i in members)  # the first mini-batch's pi_old comes with its loss
    old_logp, old_ent = {}, {}
    old_policy(model, batch, cfg, pad_id, later, old_logp, old_ent)
    zvp_advantages(batch, later, zvp, old_ent, cfg)
    m = policy_update(model, opt, batch, old_logp, old_ent, zvp, cfg, step, pad_id, ref_model=ref_model)
    m.update(mismatch_metrics(batch, old_logp))
    m["filter/zvp_sequences"] = int(all_reduce_float(len(batch.adv_tokens)))
    return m
