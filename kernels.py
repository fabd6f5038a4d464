"""Compute kernels the model calls, where torch's own ops would do work the model does not need.

- `grouped_mm`: one GEMM per expert over rows sorted by expert (`torch._grouped_mm` where
  it applies, else an exact per-expert loop).
- `GatherRows`: a row gather whose backward is a gather too. Sorting a MoE layer's
  (token, expert) pairs by expert and back are permutations; autograd would differentiate
  `x[index]` with a scatter-add (index_put with accumulate; atomic adds once inductor
  compiles it for CPU, 3x the time of the gather in the bench's compiled step).
- `causal_attention`: causal scaled dot-product attention. On CUDA it is
  `F.scaled_dot_product_attention`, whose flash kernels skip the masked upper triangle.
  torch 2.13's CPU flash kernel does not: it walks keys in blocks of 512 and computes a
  block whole even where the causal mask removes half of it, so at T <= 512 a causal
  call costs what a full one does. Here the CPU path splits the sequence into halves,
  recursively down to `CPU_ATTENTION_BLOCK`: each leaf block attends to itself causally,
  and the second half of each parent attends to its first half in full (no mask). The
  partial results merge by their log-sum-exp, as blockwise (ring) attention does
  (arXiv 2310.01889 sec. 3); the backward runs the CPU flash backward per part with the
  merged output and log-sum-exp, which gives the exact gradient of the merged softmax.
  At T = 512 this computes 3/4 of the scores (1/2 + 1/4 of the diagonal blocks).

Shape legend: B batch, H query heads, G kv heads, T tokens, d head dim, N rows, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_ATTENTION_BLOCK = 256
"""Smallest leaf of the CPU causal split: below it the flash kernel's cost per score rises
(measured on 2 threads: 128x128 blocks cost 1.5x per score what 256x256 ones do)."""


def grouped_mm(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert times that expert's matrix [N, out]; offs_E = cumulative row
    counts (int32).

    Uses `torch._grouped_mm` where it applies (CPU any float dtype; CUDA bf16 with 16-byte
    aligned strides), else an exact per-expert loop.
    """
    aligned = all((s * x_Nin.element_size()) % 16 == 0 for s in w_Ein_out.shape[1:])
    if (x_Nin.device.type == "cpu" or x_Nin.dtype == torch.bfloat16) and aligned:
        if x_Nin.dtype != torch.bfloat16 and torch.compiler.is_compiling():
            return _grouped_mm_eager(x_Nin, w_Ein_out, offs_E)  # torch 2.13 compiles it for bf16 only
        return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)
    outs, start = [], 0
    for e, end in enumerate(offs_E.tolist()):
        outs.append(x_Nin[start:end] @ w_Ein_out[e])
        start = end
    return torch.cat(outs)


@torch.compiler.disable
def _grouped_mm_eager(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm run eagerly: a graph break inside torch.compile'd blocks."""
    return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)


class GatherRows(torch.autograd.Function):
    """`GatherRows.apply(x, index, inverse, reps)` = x[index], where index takes every row of x
    exactly `reps` times and `inverse` undoes it: x[index][inverse] lists row i's copies at
    i*reps .. i*reps+reps-1. The backward gathers the gradient back through `inverse` and
    sums each row's copies."""

    @staticmethod
    def forward(ctx, x, index, inverse, reps: int):
        ctx.save_for_backward(inverse)
        ctx.reps = reps
        return x[index]

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        g = g[inverse]
        return (g.view(-1, ctx.reps, g.shape[-1]).sum(1) if ctx.reps > 1 else g), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, reps: int) -> torch.Tensor:
    """x[index] (rows); through `GatherRows` when autograd records, plain indexing otherwise
    (no autograd.Function overhead in no-grad forwards such as decoding)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return GatherRows.apply(x, index, inverse, reps)
    return x[index]


def causal_attention(q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v [B, H, T, d] in q's dtype; GQA when G < H.

    On CPU, when T splits in halves of at least CPU_ATTENTION_BLOCK, the block split of the
    module docstring; elsewhere `F.scaled_dot_product_attention(is_causal=True)`.
    """
    T = q_BHTd.shape[2]
    levels = 0
    while T % (2 << levels) == 0 and T >> (levels + 1) >= CPU_ATTENTION_BLOCK:
        levels += 1
    if q_BHTd.device.type != "cpu" or levels == 0:
        return F.scaled_dot_product_attention(q_BHTd, k_BGTd, v_BGTd, is_causal=True,
                                              enable_gqa=q_BHTd.shape[1] != k_BGTd.shape[1])
    return _block_causal(q_BHTd, k_BGTd, v_BGTd, levels)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _plan(start: int, length: int, levels: int):
    """(query rows, key columns, causal) of each flash call covering causal attention over
    rows [start, start+length): each half recursively, then the second half's queries
    against the first half's keys in full. A range's causal leaf comes before the blocks
    that merge into it."""
    if levels == 0:
        yield slice(start, start + length), slice(start, start + length), True
        return
    half = length // 2
    yield from _plan(start, half, levels - 1)
    yield from _plan(start + half, half, levels - 1)
    yield slice(start + half, start + length), slice(start, start + half), False


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTd, k_BGTd, v_BGTd, levels: int):
        out_BHTd = torch.empty_like(q_BHTd)
        lse_BHT = q_BHTd.new_empty(q_BHTd.shape[:3], dtype=torch.float32)  # log-sum-exp of each row's scores
        for rows, cols, causal in _plan(0, q_BHTd.shape[2], levels):
            o, lse = _flash(q_BHTd[:, :, rows], k_BGTd[:, :, cols], v_BGTd[:, :, cols], is_causal=causal)
            if causal:  # a leaf: these rows' first part
                out_BHTd[:, :, rows] = o
                lse_BHT[:, :, rows] = lse
                continue
            # merge two softmaxes over disjoint keys: weights exp(lse_part - lse_total)
            lse_old = lse_BHT[:, :, rows]
            total = torch.logaddexp(lse_old, lse)
            out_BHTd[:, :, rows] = (out_BHTd[:, :, rows].float() * (lse_old - total).exp()[..., None]
                                    + o.float() * (lse - total).exp()[..., None])
            lse_BHT[:, :, rows] = total
        ctx.save_for_backward(q_BHTd, k_BGTd, v_BGTd, out_BHTd, lse_BHT)
        ctx.levels = levels
        return out_BHTd

    @staticmethod
    def backward(ctx, grad_BHTd):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows, cols, causal in _plan(0, q.shape[2], ctx.levels):
            # the flash backward with the merged output and log-sum-exp: this part's exact share
            dq_p, dk_p, dv_p = _flash_backward(grad_BHTd[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                               out[:, :, rows], lse[:, :, rows], 0.0, causal)
            if causal:  # a leaf: the first part to touch its rows and its columns
                dq[:, :, rows], dk[:, :, cols], dv[:, :, cols] = dq_p, dk_p, dv_p
            else:
                dq[:, :, rows] += dq_p
                dk[:, :, cols] += dk_p
                dv[:, :, cols] += dv_p
        return dq, dk, dv, None


@torch.compiler.disable
def _block_causal(q_BHTd, k_BGTd, v_BGTd, levels: int) -> torch.Tensor:
    """Runs eagerly inside torch.compile'd blocks (a graph break): parts merge in place."""
    return _BlockCausalAttention.apply(q_BHTd, k_BGTd, v_BGTd, levels)
