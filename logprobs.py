"""Token logprobs and entropy from a policy's outputs: what the trainer's loss reads.

`chunked_logprobs` is what `model.Transformer.forward` returns with targets: log pi(target)
and the full-vocabulary entropy [B, T] fp32, computed from the final hidden states and the
lm_head weight LOGITS_CHUNK_TOKENS positions at a time, each chunk recomputed in the
backward, so the [tokens, V] fp32 logits never exist at once (at V = 151,936 and 16k-token
micro-batches they would be ~9 GiB). `token_logprobs` and `token_entropy` are the same
quantities from whole logits (tests, benches).

Notable choices:
1. fp32 from the logits on, with the temperature applied before the log-softmax, as the
   engine samples: in bf16 the small logprob differences a policy ratio measures round away.
2. NO_TARGET positions (the prompt and padding, which no loss reads) are skipped, not
   computed and masked: with long prompts they would be most of the lm_head's work.
3. The entropy carries no gradient: it feeds ESPO's entropy bins and RL-ZVP only.
Shapes: B, T, V, D (letters of the README's legend); C a chunk's positions, N = B*T, M the
positions asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target) [B, T] fp32 under softmax(logits / temperature); 0 where the target is NO_TARGET."""
    # fp32 before the temperature and the log-softmax: in bf16 they would round away the small logprob
    # differences that the policy ratios measure
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)  # (B, T, V)
    picked = logp.gather(-1, targets_BT.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T, 1) -> (B, T)
    return picked.masked_fill(targets_BT == NO_TARGET, 0.0)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary entropy -sum_v p log p [B, T] fp32, in nats."""
    logp = (logits_BTV.float() / temperature).log_softmax(dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(dim=-1)  # (B, T)


NO_TARGET = -1
"""A target id that asks for nothing: chunked_logprobs skips the position (logprob and entropy 0 there)."""
LOGITS_CHUNK_TOKENS = 1024
"""Positions whose [*, V] fp32 logits `chunked_logprobs` holds at once (a few such blocks are live at its peak)."""


def _chunk_logprobs(h_CD: torch.Tensor, w_VD: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    """log pi(target) [C] and entropy [C] fp32 of one chunk of positions (the entropy without a gradient)."""
    logp_CV = (F.linear(h_CD, w_VD).float() / temperature).log_softmax(dim=-1)  # (C, V) fp32, this chunk only
    with torch.no_grad():  # the entropy feeds ESPO's bins and RL-ZVP, never a gradient
        entropy_C = -(logp_CV.exp() * logp_CV).sum(dim=-1)
    return logp_CV.gather(-1, targets_C[:, None]).squeeze(-1), entropy_C


def chunked_logprobs(h_BTD: torch.Tensor, w_VD: torch.Tensor, targets_BT: torch.Tensor, *, temperature: float = 1.0,
                     chunk: int = LOGITS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) and entropy [B, T] fp32 from final hidden states and the lm_head weight [V, D].

    `token_logprobs` and `token_entropy` of lm_head(h), computed `chunk` flattened positions at a
    time: each chunk's logits exist only inside its own call, and with autograd recording the
    chunk is recomputed in the backward (activation checkpointing) instead of kept, so neither
    pass ever holds [B*T, V] fp32; the peak is one chunk's logits, log-softmax and gradient.
    Positions whose target is NO_TARGET (a prompt, padding) are not computed: 0 there.
    """
    from torch.utils.checkpoint import checkpoint
    B, T, D = h_BTD.shape
    h_ND, t_N = h_BTD.reshape(B * T, D), targets_BT.reshape(B * T)  # (N, D), (N,)
    if not is_fake(t_N):
        keep_M = (t_N != NO_TARGET).nonzero().squeeze(1)  # the M positions asked for (a host sync: trainer only)
    else:  # plan.py's fake tensors hold no values to select by: every position, an upper bound on the memory
        keep_M = torch.arange(B * T, device=t_N.device)
    h_MD, t_M = h_ND.index_select(0, keep_M), t_N.index_select(0, keep_M)  # (M, D), (M,): chunks over these
    logps, entropies = [], []
    for s in range(0, len(keep_M), chunk):
        h, t = h_MD[s:s + chunk], t_M[s:s + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or w_VD.requires_grad):
            lp, ent = checkpoint(_chunk_logprobs, h, w_VD, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, w_VD, t, temperature)
        logps.append(lp)
        entropies.append(ent)
    # back to [B, T], zeros where nothing was asked (index_copy: out of place, the gradient flows to the chunks);
    # clone: a module's output must not be a view (FSDP's backward hook would be lost to an in-place op on it)
    zeros_N = h_ND.new_zeros(B * T, dtype=torch.float32)
    logp_N = zeros_N.index_copy(0, keep_M, torch.cat(logps)) if logps else zeros_N
    entropy_N = zeros_N.index_copy(0, keep_M, torch.cat(entropies)) if entropies else zeros_N
    return logp_N.view(B, T).clone(), entropy_N.view(B, T).clone()

