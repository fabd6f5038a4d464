"""The trainer: every gradient step taken on the policy, SFT and RL.

`sft_step` is one step of next-token cross-entropy on demonstrations (the cold start).
`train_on_rollouts` is the policy update of one RL step, from the kept rollouts of the
step (`TrainBatch`: sequences, the engine's routes and logprobs, advantages):
  1. pi_old and its full-vocabulary entropy: the trainer's own logprobs of the sampled
     tokens before any optimizer step of this RL step, with the engine's routes replayed
     (R3, arXiv 2510.11370). The first mini-batch's come detached from its own loss forward
     (before the first step pi_old is pi_theta); the others from a no-grad pass up front.
  2. RL-ZVP token advantages (arXiv 2509.21880) for the kept zero-variance groups, from
     that entropy (espo.zvp_token_advantages).
  3. `num_minibatches` optimizer steps over a random split of the sequences, each the
     gradient of one loss (espo.policy_loss) normalised over its whole mini-batch and
     accumulated over token-budget micro-batches (`pack_microbatches`).
  4. The train-inference mismatch: k3 of KL(pi_infer || pi_old) and friends (espo.mismatch_metrics).

A completion's loss mask (`TrainBatch.loss_masks`, from sampler.Rollout.loss_mask) marks the tokens the
model did not sample, a tool's response: they stay model inputs (their KV and replayed routes shape the
tokens after them) but get NO_TARGET and mask 0 in `sequence_batch`, so no logprob is computed for them and
every consumer of the mask sees trained tokens only: the loss and its normaliser (all_lens counts trained
tokens), ESPO's entropy bins, RL-ZVP's max entropy, TIS / IcePop weights and the mismatch metrics.

A NaN or inf loss, gradient norm or advantage stops the run before the optimizer step it would
poison (`NonFiniteError`): the weights and optimizer state stay those of the last good step, so the
newest checkpoint is the last good state. Every value checked is the same on all ranks (a global
norm, an all-reduced loss or count), so every rank raises at the same step and none waits on a
collective the others never join.

Several ranks: each rank trains the rollouts it generated (they never leave it: `TrainBatch`
holds this rank's sequences and every rank's completion lengths), each mini-batch's members that
it holds, with the whole mini-batch's normaliser and its loss scaled by world (FSDP averages
gradients), so a step equals the 1-process step; ranks with fewer micro-batches run idle forwards so FSDP's and
the expert all-to-all's collectives stay matched (distributed.py).

Legend (README): B sequences, T tokens, L MoE layers, K experts per token, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from distributed import all_gather_list, all_reduce_float, idle_forward, padded_microbatches, rank_world
from espo import mismatch_metrics, policy_loss, zvp_token_advantages
from logprobs import NO_TARGET

if TYPE_CHECKING:
    from config import TrainConfig

LR_FLOOR = 0.1  # the SFT schedule's cosine ends at this fraction of the peak learning rate


def sequence_batch(seqs: list[list[int]], starts: list[int], pad_id: int, routes: list[torch.Tensor] | None = None,
                   num_layers: int = 0, top_k: int = 0, loss_masks: list[list[int] | None] | None = None):
    """Right-padded next-token batch from full sequences (prompt + completion).

    Returns inputs_BT, targets_BT (int64; NO_TARGET where no loss reads the position: the prompt,
    padding and untrained completion tokens), mask_BT (1 where the target is a trained completion
    token: positions >= start - 1 whose loss mask is 1) and, if routes are given, routes_BTLK (-1 on
    padding). loss_masks: per sequence, one 0/1 per completion token (None, or a None entry: all 1);
    a 0 (a tool's response) stays a model input, its routes replayed, but gets no target and no loss.
    """
    B, T = len(seqs), max(len(s) for s in seqs) - 1
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    # the model skips the logprob of a NO_TARGET position: for long prompts and short completions most of the
    # lm_head's [tokens, V] work would otherwise go to positions the loss multiplies by zero
    targets = torch.full((B, T), NO_TARGET, dtype=torch.long)
    mask = torch.zeros(B, T)
    routes_BTLK = torch.full((B, T, num_layers, top_k), -1, dtype=torch.int32) if routes is not None else None
    for i, (s, start) in enumerate(zip(seqs, starts)):
        n = len(s) - 1
        inputs[i, :n] = torch.tensor(s[:-1])
        targets[i, start - 1:n] = torch.tensor(s[start:])  # position t predicts token t + 1
        mask[i, start - 1:n] = 1.0  # the last prompt position predicts the first completion token
        if loss_masks is not None and loss_masks[i] is not None:
            trained_C = torch.tensor(loss_masks[i], dtype=torch.bool)
            mask[i, start - 1:n] = trained_C.float()
            # NO_TARGET: the model computes no logprob or entropy for a token it did not sample
            targets[i, start - 1:n] = torch.where(trained_C, targets[i, start - 1:n], NO_TARGET)
        if routes is not None:
            routes_BTLK[i, :n] = routes[i]  # the engine recorded routes for every token fed to the model
    return inputs, targets, mask, routes_BTLK


def pad_rows(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    """1-D tensors stacked into [B, T], zero-padded on the right."""
    out = rows[0].new_zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def lr_at(step: int, peak: float, warmup: int, total: int, cosine: bool) -> float:
    """Linear warm-up over `warmup` steps, then constant or (cosine) down to LR_FLOOR of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if not cosine:
        return peak
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * frac)))


class NonFiniteError(FloatingPointError):
    """A NaN or inf found before the optimizer step it would have poisoned.

    quantity: "loss", "grad_norm" or "advantages"; stage: "sft" or "rl"; step: the step's index in its
    stage; detail: the value (or how many values were not finite). A FloatingPointError rather than a
    ValueError: the config was valid, the numbers went bad (train.py's __main__ reports it in one line).
    """

    def __init__(self, quantity: str, stage: str, step: int, detail: str):
        self.quantity, self.stage, self.step, self.detail = quantity, stage, step, detail
        super().__init__(f"non-finite {quantity} ({detail}) at {stage} step {step}")


def check_finite(value: float, quantity: str, stage: str, step: int):
    """Raise NonFiniteError if value is NaN or inf. Give it a value every rank shares (a global norm, an
    all-reduced loss), so all ranks raise together."""
    if not math.isfinite(value):
        raise NonFiniteError(quantity, stage, step, str(value))


def optimizer_step(model, opt, cfg: TrainConfig, lr: float, loss: float, *, stage: str, step: int) -> float:
    """Clip the global gradient norm to cfg.grad_clip, step, zero the gradients; returns the norm before clipping.

    loss: the step's loss, summed or averaged over ranks. Raises NonFiniteError, before opt.step(), if it or
    the norm is NaN or inf: the weights and the optimizer's moments stay those of the last good step.
    """
    check_finite(loss, "loss", stage, step)
    for g in opt.param_groups:
        g["lr"] = lr
    if rank_world()[1] > 1:  # DTensor grads on two meshes (dense and expert): torchtitan's norm spans both
        from torchtitan.distributed.utils import clip_grad_norm_
        norm = clip_grad_norm_(list(model.parameters()), cfg.grad_clip, ep_enabled=cfg.ep > 1)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP
    # the norm before clipping, global over ranks: one NaN or inf gradient anywhere makes it non-finite (the clip
    # has already scaled the gradients by NaN then, but they are never applied)
    check_finite(norm, "grad_norm", stage, step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def sft_step(model, opt, seqs: list[list[int]], starts: list[int], pad_id: int, lr: float, cfg: TrainConfig, *,
             step: int, loss_masks: list[list[int] | None] | None = None) -> float:
    """SFT step `step`: mean cross-entropy of the completion tokens of seqs (prompt + demonstration);
    returns the loss. loss_masks: per sequence, 0 at a demonstration's tool turns (fed, never imitated), as
    sequence_batch reads them (None: every completion token). Multi-rank: every rank gets the whole batch and
    trains rows r, r + world, ..., its loss divided by the whole batch's token count (times world: FSDP
    averages gradients). Raises NonFiniteError (optimizer_step) on a NaN or inf loss or gradient norm."""
    rank, world = rank_world()
    masks = loss_masks or [None] * len(seqs)
    if world > 1:  # the whole batch's loss tokens
        num_tokens = sum(len(s) - p if m is None else sum(m) for s, p, m in zip(seqs, starts, masks))
        seqs, starts, masks = seqs[rank::world], starts[rank::world], masks[rank::world]  # this rank's rows
    inputs, targets, mask, _ = sequence_batch(seqs, starts, pad_id, loss_masks=masks)
    (logp, _), _ = model(inputs.to(cfg.device), targets.to(cfg.device))  # chunked: no [B, T, V] logits
    mask = mask.to(cfg.device)
    # selected, not multiplied by the mask: NaN * 0 is NaN, so a NaN at a padding position would poison the sum
    nll = torch.where(mask.bool(), -logp, 0.0)
    if world > 1:
        # each rank's share of the mean over the whole batch; FSDP's reduce-scatter averages the
        # gradients over ranks, so times world makes their sum the 1-process gradient
        loss = nll.sum() / num_tokens
        (loss * world).backward()
        value = all_reduce_float(loss.item())
    else:
        loss = nll.sum() / mask.sum()
        loss.backward()
        value = loss.item()
    optimizer_step(model, opt, cfg, lr, value, stage="sft", step=step)
    return value


def pack_microbatches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices packed so that len(mb) * max(lengths in mb) <= token_budget (padding counted).

    Longest first, each micro-batch filled until the next sequence would break the budget.
    A sequence longer than the budget gets a micro-batch of its own.
    Raises ValueError if token_budget < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    # First fit decreasing written as next fit: a closed micro-batch is at least as wide as the current one (its
    # first member is no shorter) and already holds as many rows as its width allows, so no later, shorter
    # sequence could fit in it either.
    # For this cost (rows x widest row) the result also has the fewest micro-batches: an exchange argument
    # moves the longest sequences into the micro-batch that holds the longest, whose width they cannot raise.
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        # sorted descending, so the first member is the longest and sets the padded width
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)  # an empty micro-batch takes any sequence, over budget or not: it cannot be split
    if current:
        batches.append(current)
    return batches


@dataclass
class TrainBatch:
    """The kept rollouts of one RL step as trainer inputs (index i = one sequence), and what the
    trainer learns about them: pi_old, its entropy and RL-ZVP's token advantages."""
    seqs: list[list[int]]  # prompt + completion ids
    starts: list[int]  # prompt lengths: the completion starts at seqs[i][starts[i]]
    routes: list[torch.Tensor]  # [len(seqs[i]) - 1, L, K] routed experts recorded by the engine
    adv_B: torch.Tensor  # one advantage per sequence
    infer_logp: list[torch.Tensor] | None = None  # [len(completion)] the engine's log pi_infer of each completion token
    # per sequence, one 0/1 per completion token (sampler.Rollout.loss_mask): 0 = fed, never trained (a tool's
    # response); None (the list or an entry) = all trained. Every consumer of the trainer's mask sees trained only.
    loss_masks: list[list[int] | None] | None = None
    zvp: dict[int, bool] = field(default_factory=dict)  # i -> all correct, for the kept zero-variance groups (RL-ZVP)
    pad_id: int = 0
    old_logp: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [len(seqs[i]) - 1] log pi_old (set_old)
    old_ent: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [len(seqs[i]) - 1] entropy of pi_old (nats)
    adv_tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # i -> [len(seqs[i]) - 1] token advantages
    # Several ranks: the step's kept sequences are numbered 0..N-1 the same way on every rank; this rank holds
    # those it generated, ids[i] being sequence i's number, and knows every one's trained completion tokens
    # (all_lens, the token-mean loss's normaliser). Defaults: one process, which holds them all.
    ids: list[int] | None = None
    all_lens: list[int] | None = None

    def __post_init__(self):
        """Raises ValueError if a loss mask's length is not its completion's, or it holds other than 0 and 1."""
        if self.loss_masks is not None:
            for i, m in enumerate(self.loss_masks):
                if m is None:
                    continue
                num_completion = len(self.seqs[i]) - self.starts[i]
                if len(m) != num_completion:
                    raise ValueError(f"sequence {i}: loss_mask has {len(m)} entries; its completion has "
                                     f"{num_completion} tokens (one 0/1 per completion token)")
                if any(x not in (0, 1) for x in m):
                    raise ValueError(f"sequence {i}: loss_mask holds {sorted(set(m) - {0, 1})}; valid: 0 and 1")
        if self.ids is None:
            self.ids = list(range(len(self.seqs)))
        if self.all_lens is None:
            self.all_lens = [len(q) - st for q, st in zip(self.seqs, self.starts)]
            if self.loss_masks is not None:
                self.all_lens = [n if m is None else sum(m) for n, m in zip(self.all_lens, self.loss_masks)]

    def trained(self, i: int) -> torch.Tensor | None:
        """Sequence i's trained completion tokens, bool [len(completion)]; None when all are trained."""
        m = self.loss_masks[i] if self.loss_masks is not None else None
        return None if m is None else torch.tensor(m, dtype=torch.bool)

    def local(self, members: list[int]) -> list[int]:
        """The members (numbers among all ranks' sequences) this rank holds, as its own indices, in order."""
        pos = {g: i for i, g in enumerate(self.ids)}
        return [pos[g] for g in members if g in pos]

    def set_old(self, idx: list[int], logp_BT: torch.Tensor, ent_BT: torch.Tensor, zvp_alpha: float):
        """Record pi_old and its entropy for sequences idx (rows of the padded [B, T] tensors), and the
        RL-ZVP token advantages that follow from that entropy for the zero-variance ones."""
        for j, i in enumerate(idx):
            n = len(self.seqs[i]) - 1  # unpadded: other micro-batches pad to their own width
            self.old_logp[i], self.old_ent[i] = logp_BT[j, :n].detach(), ent_BT[j, :n].detach()
            if i in self.zvp:
                s = self.starts[i] - 1  # the completion's first target position
                a = torch.zeros(n)
                trained = self.trained(i)
                if trained is None:
                    a[s:] = zvp_token_advantages(self.old_ent[i][s:n].cpu(), correct=self.zvp[i], alpha=zvp_alpha)
                else:  # the max entropy over trained tokens only: a tool token has none (0, NO_TARGET)
                    ent = self.old_ent[i][s:n].cpu()[trained]
                    a[s:][trained] = zvp_token_advantages(ent, correct=self.zvp[i], alpha=zvp_alpha)
                self.adv_tokens[i] = a

    def advantages(self, idx: list[int], T: int) -> torch.Tensor:
        """Advantages of sequences idx: [b] per sequence, or [b, T] per token when any of them has token advantages."""
        if not any(i in self.adv_tokens for i in idx):
            return self.adv_B[idx]
        adv_bT = self.adv_B[idx][:, None].repeat(1, T)  # (b, T): a sequence's advantage on each of its tokens
        for j, i in enumerate(idx):
            if i in self.adv_tokens:  # RL-ZVP rows: their own per-token values, 0 on padding
                a = self.adv_tokens[i]
                adv_bT[j] = 0.0
                adv_bT[j, :len(a)] = a
        return adv_bT

    def micro(self, idx: list[int], cfg: TrainConfig):
        """inputs, targets, loss mask [B, T] and routes to replay [B, T, L, K] (or None) for sequences idx."""
        masks = [self.loss_masks[i] for i in idx] if self.loss_masks is not None else None
        inputs, targets, mask, routes = sequence_batch([self.seqs[i] for i in idx], [self.starts[i] for i in idx],
                                                       self.pad_id, [self.routes[i] for i in idx],
                                                       cfg.model.num_moe_layers, cfg.model.top_k, masks)
        dev = cfg.device
        return inputs.to(dev), targets.to(dev), mask.to(dev), (routes.to(dev) if cfg.router_replay else None)

    def engine_logp(self, idx: list[int], T: int) -> torch.Tensor:
        """The engine's logprobs of sequences idx, [B, T], where the loss mask is 1; 0 elsewhere."""
        rows = [torch.zeros(len(self.seqs[i]) - 1) for i in idx]
        for row, i in zip(rows, idx):
            row[self.starts[i] - 1:] = self.infer_logp[i]  # target position t predicts token t + 1: starts at start - 1
            trained = self.trained(i)
            if trained is not None:  # a tool token's engine logprob (if any) is never read: selected, not multiplied
                row[self.starts[i] - 1:] = torch.where(trained, row[self.starts[i] - 1:], 0.0)
        return pad_rows(rows, T)


def minibatches(num_seqs: int, cfg: TrainConfig, step: int) -> list[list[int]]:
    """The step's random split of sequence indices into num_minibatches mini-batches (one optimizer step each)."""
    # seeded by the step alone, so every rank (and a resumed run) draws the same split
    perm = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(cfg.seed + step)).tolist()
    n_mb = min(cfg.num_minibatches, len(perm))
    return [perm[mb::n_mb] for mb in range(n_mb)]


def rank_microbatches(batch: TrainBatch, seqs: list[int], cfg: TrainConfig) -> list[list[int]]:
    """seqs packed into micro-batches of at most cfg.microbatch_tokens padded tokens; with several
    ranks padded with empty ones to the most any rank has (every rank runs as many forwards)."""
    packed = pack_microbatches([len(batch.seqs[i]) for i in seqs], cfg.microbatch_tokens)
    micro = [[seqs[j] for j in idx] for idx in packed]  # positions in seqs -> sequence indices
    return padded_microbatches(micro) if rank_world()[1] > 1 else micro


def policy_logprobs(model, batch: TrainBatch, idx: list[int], cfg: TrainConfig):
    """log pi and its entropy [b, T] fp32 of sequences idx under `model`, the engine's routes replayed, and
    the loss mask [b, T]: the trainer's one forward (pi_old, the loss, the KL reference).

    At the rollout temperature, as the engine sampled, so pi_old is the distribution pi_infer
    approximates. The model computes them chunk by chunk from its hidden states: the [b, T, V]
    logits are never held.
    """
    inputs, targets, mask, routes = batch.micro(idx, cfg)
    (logp_BT, entropy_BT), _ = model(inputs, targets, temperature=cfg.sampling.temperature, routed_experts=routes)
    return logp_BT, entropy_BT, mask


@torch.no_grad()
def old_logprobs(model, batch: TrainBatch, seqs: list[int], cfg: TrainConfig):
    """pi_old for sequences seqs (this rank's): a no-grad forward of the current weights, into batch.set_old."""
    for idx in rank_microbatches(batch, seqs, cfg):
        if not idx:
            idle_forward(model, cfg, backward=False)
            continue
        logp_BT, entropy_BT, _ = policy_logprobs(model, batch, idx, cfg)
        batch.set_old(idx, logp_BT, entropy_BT, cfg.filter.zvp_alpha)


def minibatch_backward(model, batch: TrainBatch, members: list[int], first: bool, cfg: TrainConfig,
                       ref_model=None) -> tuple[float, list[dict]]:
    """Accumulate the gradient of one mini-batch's loss (this rank's share of `members`); returns the
    loss (summed over ranks) and each micro-batch's loss metrics. first: the step's first mini-batch,
    whose pi_old comes from this forward."""
    world = rank_world()[1]
    loss_cfg, agg = cfg.loss, cfg.loss.aggregation_name
    # what the mini-batch's loss is divided by, over every rank's members: its tokens (token-mean), its sequences
    # times the generation budget (Dr.GRPO's constant), else its sequences; its micro-batches add up to its mean
    normalizer = (sum(batch.all_lens[g] for g in members) if agg == "token-mean"
                  else len(members) * (cfg.sampling.max_new_tokens if agg == "seq-mean-token-sum-norm" else 1))
    needs_infer = loss_cfg.tis_cap is not None or loss_cfg.icepop is not None
    total, metrics = 0.0, []
    for idx in rank_microbatches(batch, batch.local(members), cfg):
        if not idx:  # this rank has run out of micro-batches: join the others' collectives
            idle_forward(model, cfg, backward=True)
            if ref_model is not None:
                idle_forward(ref_model, cfg, backward=False)  # its all-gathers too
            continue
        logp, entropy, mask = policy_logprobs(model, batch, idx, cfg)
        T = mask.shape[1]
        if first:  # pi_old = pi_theta until the first optimizer step (detached: no graph is kept)
            batch.set_old(idx, logp, entropy, cfg.filter.zvp_alpha)
        ref_logp = None
        if ref_model is not None:  # the KL penalty's reference, under the same replayed routes
            with torch.no_grad():
                ref_logp = policy_logprobs(ref_model, batch, idx, cfg)[0]
        old_logp_BT = pad_rows([batch.old_logp[i] for i in idx], T)
        loss, lm = policy_loss(
            logp, old_logp_BT, batch.advantages(idx, T).to(cfg.device), mask, loss_cfg, vocab_size=cfg.model.vocab_size,
            old_entropy_BT=pad_rows([batch.old_ent[i] for i in idx], T), ref_logp_BT=ref_logp,
            infer_logp_BT=batch.engine_logp(idx, T).to(cfg.device) if needs_infer else None, normalizer=normalizer)
        (loss * world if world > 1 else loss).backward()  # times world: FSDP averages gradients over ranks
        total += loss.item()
        metrics.append(lm)
    return all_reduce_float(total), metrics


def train_on_rollouts(model, opt, batch: TrainBatch, step: int, cfg: TrainConfig, ref_model=None) -> dict:
    """The policy update of one RL step (module docstring, 1-4); returns metrics.

    pi_old is recomputed by the trainer (not taken from the engine), so with stale rollouts the
    ratio is taken against the current weights and pi_infer / pi_old is what TIS or IcePop
    correct. ref_model: the frozen reference of the KL penalty (needed when cfg.loss.kl_coef != 0).
    """
    split = minibatches(len(batch.all_lens), cfg, step)  # over every rank's sequences, the same on all
    check_advantages([batch.adv_B], step)  # before any forward: a NaN reward or std would reach every weight
    # pi_old must be taken before the first optimizer step moves the weights. Mini-batch 0's loss forward
    # runs before it, so its pi_old comes detached from that forward; the others need a no-grad pass now.
    later = sorted(i for members in split[1:] for i in batch.local(members))
    old_logprobs(model, batch, later, cfg)
    m, losses, lmetrics = {}, [], []
    lr = lr_at(step, cfg.lr, cfg.lr_warmup_steps, cfg.rl_steps, cosine=False)
    for mb, members in enumerate(split):
        loss, metrics = minibatch_backward(model, batch, members, mb == 0, cfg, ref_model)
        if mb == 0:  # RL-ZVP's token advantages come from pi_old's entropy: all of them exist from here on
            check_advantages(list(batch.adv_tokens.values()), step)
        m["grad_norm"] = optimizer_step(model, opt, cfg, lr, loss, stage="rl", step=step)
        losses.append(loss)
        lmetrics += metrics
    lmetrics = all_gather_list(lmetrics)  # every rank's micro-batches, so the means are the 1-process ones
    m["loss"], m["optimizer_steps"] = sum(losses) / len(losses), len(split)
    m.update({f"loss/{k}": sum(x[k] for x in lmetrics) / len(lmetrics) for k in lmetrics[0]})
    m.update(mismatch(batch))
    m["filter/zvp_sequences"] = int(all_reduce_float(len(batch.adv_tokens)))
    return m


def check_advantages(adv: list[torch.Tensor], step: int):
    """Raise NonFiniteError if any advantage of RL step `step` is NaN or inf on any rank (each rank holds
    only its own sequences', so the count of bad ones is summed over ranks and all raise together)."""
    bad = all_reduce_float(float(sum(int((~torch.isfinite(a)).sum()) for a in adv)))
    if bad:
        raise NonFiniteError("advantages", "rl", step, f"{int(bad)} values")


def mismatch(batch: TrainBatch) -> dict:
    """espo.mismatch_metrics of the engine's logprobs against pi_old, over the trained tokens of the sequences
    whose pi_old this rank computed; with several ranks their token-weighted mean (their max for the max)."""
    idx = list(batch.old_logp)
    infer = [batch.infer_logp[i] for i in idx]
    old = [batch.old_logp[i][batch.starts[i] - 1:].cpu() for i in idx]  # pi_old of the completion tokens only
    trained = [batch.trained(i) for i in idx]
    infer = [x if t is None else x[t] for x, t in zip(infer, trained)]  # a tool token was not sampled: no mismatch
    old = [x if t is None else x[t] for x, t in zip(old, trained)]
    m = mismatch_metrics(infer, old)
    if rank_world()[1] == 1:
        return m
    n = float(sum(len(x) for x in infer))
    total = all_reduce_float(n)
    return {k: all_reduce_float(v, "max") if k.startswith("mismatch/max") else all_reduce_float(v * n) / max(total, 1.0)
            for k, v in m.items()}
