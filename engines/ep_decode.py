"""Expert-parallel decode without host syncs: `capacity_experts`, a fixed-capacity all-to-all dispatch that
gives the same numbers as torchtitan's dispatcher, and `capacity_dispatch`, the mode in which a model's MoE
layers use it (model.MoE.capacity). Shapes as in model.py, with this file's Y, e, A, Z (see capacity_experts).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn

from model import MoE


def capacity_experts(experts: nn.Module, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, *,
                     exchange, ep: int, max_tokens: int) -> torch.Tensor:
    """Expert-parallel weighted sum over each token's K experts [N, D], in x's dtype, with no host sync.

    torchtitan's AllToAllTokenDispatcher sizes its all-to-alls by the routes (a counts all-to-all,
    then the split sizes read on the host), so every MoE layer of a decode step waits for the host
    and the step cannot be captured in a CUDA graph. Here every shape is fixed by max_tokens: each
    rank sends each rank of the ep group a buffer of A = max_tokens * min(K, e) rows (the most that
    max_tokens tokens can route to one rank's e experts), its real rows first (sorted by expert, as
    torchtitan sorts them), zeros after. The per-expert counts travel on the device (a [Y, e]
    all-to-all), the receiver sorts its rows by local expert with device-side offsets (the padding
    after every real row, past the grouped GEMMs' last offset, so no expert computes it), and the
    outputs return through the slots they came in. Three equal-split all-to-alls per layer, as
    torchtitan's three, and the host reads nothing (the experts' grouped GEMMs take device offsets
    in bf16 on CUDA and anywhere on CPU; ops.grouped_mm's fp32-on-CUDA fallback still reads them).
    Each all-to-all moves Y * A rows whatever the routes: meant for decode steps and short inputs.

    Equal to torchtitan's path, not just close: each expert's GEMM sees the same rows in the same
    order (by source rank, then the source's token order), and each token's K outputs are weighted
    in fp32, cast to x's dtype and summed in fp32 in ascending expert order before one cast back,
    what torchtitan's scatter_add computes (on CPU; CUDA's deterministic scatter_add is meant to
    match, to be checked on a GPU).

    Shapes (this function's letters, beside the legend's): Y ranks of the ep group, e = E / Y
    experts per rank, A rows per (source, destination) rank pair, Z = Y * A rows of a buffer.
    exchange: an all-to-all with equal splits over the ep group's Y ranks, t[Y, ...] -> t[Y, ...]
    (block w goes to rank w, and block w of the result came from rank w): `MoE.exchange`, set by
    distributed.parallelize. Every rank of the group must call this with the same max_tokens.
    Raises ValueError when N > max_tokens.
    """
    N, K = ids_NK.shape
    if N > max_tokens:
        raise ValueError(f"{N} tokens in one forward under capacity_dispatch(max_tokens={max_tokens}); "
                         f"enter it with max_tokens >= the most tokens any rank feeds one forward")
    Y, D, dev = ep, x_ND.shape[1], x_ND.device
    E = experts.w13.shape[0]  # every expert (the DTensor's global shape under EP)
    e = E // Y
    A = max_tokens * min(K, e)  # a token reaches at most min(K, e) experts of one rank
    slot_A = torch.arange(A, device=dev)

    # --- send: this rank's (token, expert) pairs, sorted by expert, in Y fixed-size blocks
    pair_R = ids_NK.flatten()  # (R,) the expert of pair p = n*K + k
    # (E,) rows per expert; scatter_add_, not bincount, whose output size is read on the host
    counts_E = pair_R.new_zeros(E).scatter_add_(0, pair_R, torch.ones_like(pair_R))
    order_R = pair_R.argsort(stable=True)  # pairs by expert, token order within one: torchtitan's order
    counts_Y = counts_E.view(Y, e).sum(1)  # (Y,) rows for each destination rank
    start_Y = counts_Y.cumsum(0) - counts_Y  # (Y,) where each destination's rows start in order_R
    real_YA = slot_A < counts_Y[:, None]  # (Y, A) slot a of block w holds a real row
    row_YA = (start_Y[:, None] + slot_A).clamp(max=N * K - 1)  # (Y, A) its sorted row; padding's is any, masked
    send_YAD = torch.where(real_YA[..., None], x_ND[order_R[row_YA] // K], 0)  # (Y, A, D), zeros in the padding

    # --- receive: each source's rows for this rank's experts, re-sorted expert-major (torchtitan's _permute)
    recv_Ye = exchange(counts_E.view(Y, e))  # (Y, e): rows source w sends each of this rank's experts
    recv_YAD = exchange(send_YAD)  # (Y, A, D): block w from source w, sorted by local expert, then padding
    real_YA, pos_Z, inv_Z = expert_major(recv_Ye, A)
    x_ZD = recv_YAD.view(Y * A, D)[inv_Z]  # (Z, D): expert 0's rows from source 0, 1, ..., expert 1's, ..., padding
    out_ZD = experts(x_ZD, recv_Ye.sum(0))  # (Z, D); padding rows lie past the last offset: unspecified, unread

    # --- return: the outputs go back through the slots they came in, then the combine
    back_YAD = torch.where(real_YA[..., None], out_ZD[pos_Z].view(Y, A, D), 0)  # (Z, D) -> (Y, A, D), source order
    ret_YAD = exchange(back_YAD)  # (Y, A, D): block w from rank w, in this rank's send slots
    dest_R = pair_R[order_R] // e  # (R,) each sorted row's destination rank
    slot_sorted_R = dest_R * A + torch.arange(N * K, device=dev) - start_Y[dest_R]  # (R,) its slot in ret_YAD
    slot_R = torch.empty_like(slot_sorted_R).scatter_(0, order_R, slot_sorted_R)  # (R,) pair p's slot, p = n*K + k
    return combine(ret_YAD.view(Y * A, D), slot_R.view(N, K), ids_NK, weights_NK, x_ND.dtype)


def expert_major(recv_Ye: torch.Tensor, A: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each received row goes for the experts' grouped GEMMs (torchtitan's _permute, on the device): of Y
    source blocks of A slots, recv_Ye [Y, e] real rows per (source, local expert) first in each block, sorted by
    expert. Returns real_YA [Y, A] (bool: a real row), pos_Z [Z] (each slot's expert-major position: expert 0's
    rows from source 0, 1, ..., expert 1's, ..., the padding after every real row, in order) and inv_Z [Z], its
    inverse permutation."""
    Y, e = recv_Ye.shape
    dev = recv_Ye.device
    slot_A = torch.arange(A, device=dev)
    end_Ye = recv_Ye.cumsum(1)  # (Y, e) where each expert's rows end within source w's block
    begin_Ye = end_Ye - recv_Ye
    real_YA = slot_A < end_Ye[:, -1:]  # (Y, A) real received rows
    # (Y, A) the local expert of each received row (padding clamped to the last; masked below)
    exp_YA = torch.searchsorted(end_Ye, slot_A.expand(Y, A).contiguous(), right=True).clamp(max=e - 1)
    seg = recv_Ye.t().flatten()  # (e*Y,) expert-major segments: (expert 0, source 0), (0, 1), ..., (1, 0), ...
    seg_begin_eY = (seg.cumsum(0) - seg).view(e, Y)  # (e, Y) where each segment starts in expert-major order
    src_YA = torch.arange(Y, device=dev)[:, None].expand(Y, A)
    pos_YA = seg_begin_eY[exp_YA, src_YA] + slot_A - begin_Ye.gather(1, exp_YA)  # (Y, A) expert-major position
    real_Z, pad_Z = real_YA.flatten(), ~real_YA.flatten()
    # (Z,) a permutation of 0..Z-1: real rows to their expert-major positions, the padding after them in order
    pos_Z = torch.where(real_Z, pos_YA.flatten(), recv_Ye.sum() + pad_Z.cumsum(0) - 1)
    inv_Z = torch.empty_like(pos_Z).scatter_(0, pos_Z, torch.arange(Y * A, device=dev))  # each index written once
    return real_YA, pos_Z, inv_Z


def combine(ret_ZD: torch.Tensor, slot_NK: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Each token's K expert outputs (rows slot_NK of ret_ZD) as torchtitan's combine sums them: weighted in fp32,
    cast to dtype, added in ascending expert order in fp32, cast back once. Returns [N, D] in dtype."""
    N, K = ids_NK.shape
    by_expert_NK = ids_NK.argsort(dim=1, stable=True)  # (N, K) each token's pairs in ascending expert order
    y_NKD = ret_ZD[slot_NK.gather(1, by_expert_NK)]  # (N, K, D)
    y_NKD = (y_NKD.float() * weights_NK.gather(1, by_expert_NK)[..., None]).to(dtype)
    y_ND = torch.zeros(N, ret_ZD.shape[1], device=ret_ZD.device)
    for k in range(K):
        y_ND = y_ND + y_NKD[:, k].float()
    return y_ND.to(dtype)


@contextmanager
def capacity_dispatch(model: nn.Module, max_tokens: int):
    """Within the block, every expert-parallel MoE forward without autograd runs `capacity_experts`
    (no host sync in the MoE layers, which a CUDA graph of a decode step needs) instead of
    torchtitan's dispatcher, with the same numbers.

    Off by default: a collective mode, so the caller, not the input's shape, turns it on. Every rank
    of an ep group must enter it with the same max_tokens (the buffers' size) and run the same
    forwards inside it; a rank that decided alone (its own N or T) would meet the others in a
    different all-to-all. Training keeps torchtitan's dispatcher (forwards that record autograd).
    A model without expert parallelism passes through (run_experts never syncs).
    Raises ValueError when max_tokens < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}; need >= 1 (the most tokens any rank feeds one forward)")
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.exchange is not None]
    for m in moes:
        m.capacity = partial(capacity_experts, exchange=m.exchange, ep=m.dispatcher.ep_mesh.size(),
                             max_tokens=max_tokens)
    try:
        yield model
    finally:
        for m in moes:
            m.capacity = None
