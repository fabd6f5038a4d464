"""The tensor ops the model's modules call: functions of tensors alone, no ModelConfig, no module state.

model.py builds the network from these; weights.py's FP8 experts and the tests call them too. Each is
torch's own op with this project's choices around it:
1. RoPE's rotation (`apply_rope`, arXiv 2104.09864) on the first r dims of each head, in HF's
   rotate_half layout and arithmetic (cos and sin cast to the activation dtype), so logits match HF's.
2. Attention through SDPA: `fused_attention` allows only SDPA's fused kernels on CUDA (flash,
   memory-efficient, cuDNN), so a call that only the O(T^2)-memory math kernel would take raises
   instead of silently slowing down; `single_query_attention` is a decode step's one query per row as
   two batched matmuls, GQA (arXiv 2305.13245) without repeating k and v.
3. SwiGLU (`swiglu`, arXiv 2002.05202) on a fused [gate | up] projection.
4. Grouped GEMMs over rows sorted by expert (`grouped_mm`): `torch._grouped_mm` where it runs, one
   matmul per expert where it does not, an even split on plan.py's fake tensors; under torch.compile
   in fp32 an op opaque to the compiler (the custom op `everyprompt::grouped_mm`, a name compiled
   graphs keep) or a graph break.
5. A row gather for permutations (`gather_rows`, `GatherRows`) whose backward gathers too, where
   autograd would scatter-add (atomics on GPU, not bitwise repeatable).
Shapes: B, T, S, D, H, J, d, r, N, E, I (letters of the README's legend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch._subclasses.fake_tensor import is_fake


def apply_rope(x_BHTd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """Rotate the first r dims of each head by halves (HF "rotate_half" layout); the rest pass."""
    r = cos_BTr.shape[-1]
    rot, rest = x_BHTd[..., :r], x_BHTd[..., r:]  # (B, H, T, r), (B, H, T, d - r)
    x1, x2 = rot.chunk(2, dim=-1)  # (B, H, T, r/2) each: the two coordinates of each rotated pair
    # cos and sin in x's dtype, as HF casts them: bf16 products then round as HF's do
    cos, sin = cos_BTr[:, None].to(x_BHTd.dtype), sin_BTr[:, None].to(x_BHTd.dtype)  # (B, 1, T, r)
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): a 2-D rotation by pos * theta_i per pair
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    # partial rotary (GLM-4.5): the last d - r dims carry no position
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


FUSED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
"""SDPA's kernels allowed on CUDA, each O(T) in memory; the math kernel (T x S scores) is left out, so a call
that only it could run raises instead of silently slowing down."""


def fused_attention(q_BHTd: torch.Tensor, k_BJSd: torch.Tensor, v_BJSd: torch.Tensor,
                    mask_B1TS: torch.Tensor | None, *, call: str) -> torch.Tensor:
    """SDPA [B, H, T, d] over J kv heads (GQA), with mask_B1TS (bool, True = attend, or additive) or causal
    without one; on CUDA only under `FUSED_SDPA_BACKENDS`. On CPU it is the plain SDPA call.

    Which CUDA kernel takes what (pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, the
    can_use_* gates of torch 2.x): flash takes GQA (enable_gqa) but no attn_mask, fp16/bf16 only,
    head_dim <= 256; memory-efficient takes a mask and fp32, head_dim a multiple of 8 in bf16, but not
    GQA (`check_batch_size_and_num_heads_dense<false>`; pytorch PR 191085 adds it later); cuDNN takes
    both in fp16/bf16 but comes after math in the default priority order (at::Context's
    sdp_priority_order: flash, efficient, math, cudnn). So where flash cannot run (a mask, or fp32) the
    kv heads are repeated to H for memory-efficient (or cuDNN): a copy of k and v, not T x S scores.
    call names the caller in the error. Raises RuntimeError when no fused kernel takes the call (torch
    warns each kernel's reason just before).
    """
    H, J = q_BHTd.shape[1], k_BJSd.shape[1]
    if not q_BHTd.is_cuda:  # CPU: its own flash kernel takes masks and GQA
        return F.scaled_dot_product_attention(q_BHTd, k_BJSd, v_BJSd, attn_mask=mask_B1TS,
                                              is_causal=mask_B1TS is None, enable_gqa=H != J)
    if H != J and (mask_B1TS is not None or q_BHTd.dtype not in (torch.float16, torch.bfloat16)):
        # kv head j to query heads [j * H/J, (j+1) * H/J), enable_gqa's order: (B, J, S, d) -> (B, H, S, d)
        k_BJSd, v_BJSd = k_BJSd.repeat_interleave(H // J, dim=1), v_BJSd.repeat_interleave(H // J, dim=1)
    try:
        with sdpa_kernel(FUSED_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q_BHTd, k_BJSd, v_BJSd, attn_mask=mask_B1TS,
                                                  is_causal=mask_B1TS is None, enable_gqa=k_BJSd.shape[1] != H)
    except RuntimeError as e:
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):  # torch's two wordings
            raise
        mask = "causal" if mask_B1TS is None else f"mask {tuple(mask_B1TS.shape)} {mask_B1TS.dtype}"
        raise RuntimeError(
            f"{call}: no fused SDPA kernel (flash, memory-efficient, cuDNN) takes q {tuple(q_BHTd.shape)}, "
            f"k/v {tuple(k_BJSd.shape)}, {mask}, dtype {q_BHTd.dtype}, and the O(T^2) math kernel is not allowed. "
            "The warnings above give each kernel's reason; what they take: dtype bfloat16 (config dtype), head_dim "
            "a multiple of 8 (at most 256 for flash), a mask that needs no grad.") from e


def single_query_attention(q_BH1d: torch.Tensor, k_BJSd: torch.Tensor, v_BJSd: torch.Tensor,
                           bias_B11S: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v for one query per row [B, H, 1, d] (a decode step), GQA over J kv heads.

    The same result as SDPA with an additive mask, as two batched matmuls: for a single query
    they skip SDPA's general path, whose setup costs more than its arithmetic. bias_B11S: 0
    where the key is attended, -inf elsewhere (a bool mask, True = attend, is turned into it).
    """
    B, H, _, d = q_BH1d.shape
    J = k_BJSd.shape[1]
    if bias_B11S.dtype == torch.bool:
        bias_B11S = torch.zeros(bias_B11S.shape, device=q_BH1d.device).masked_fill_(~bias_B11S, float("-inf"))
    # query heads [j * H/J, (j+1) * H/J) read kv head j (SDPA's enable_gqa order): viewing q as (B, J, H/J, d)
    # puts each head under its kv head, so k and v are never repeated
    scores = torch.matmul(q_BH1d.view(B, J, H // J, d), k_BJSd.transpose(-1, -2)) * d ** -0.5  # (B, J, H/J, S)
    probs = (scores.float() + bias_B11S).softmax(dim=-1).to(v_BJSd.dtype)  # softmax in fp32 whatever the dtype
    return torch.matmul(probs, v_BJSd).view(B, H, 1, d)  # (B, J, H/J, d) -> (B, H, 1, d), head order kept


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] along the last dim (arXiv 2002.05202)."""
    gate, up = h.chunk(2, dim=-1)  # (..., 2I) -> two (..., I) views
    return F.silu(gate) * up


def grouped_mm(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert times that expert's matrix [N, out]; offs_E = cumulative row counts (int32).

    `torch._grouped_mm` where it runs (CPU in any float dtype; CUDA in bf16, 16-byte aligned
    strides): one kernel for every expert, no host sync. Elsewhere (fp32 on CUDA) one matmul per
    expert, which reads the offsets on the host. Rows past offs_E[-1] belong to no expert: their
    output rows are unspecified (torch._grouped_mm leaves them unwritten; the fallback gives zeros).
    """
    # is_fake is opaque to dynamo (a graph break); compiled code is never plan.py's, which runs eagerly
    if not torch.compiler.is_compiling() and is_fake(x_Nin):
        # plan.py's fake tensors hold no routes to split by: an even split stands in, saving what _grouped_mm
        # saves for its backward (x and w), so the planned memory is the real one
        E = w_Ein_out.shape[0]
        return torch.bmm(x_Nin.view(E, -1, x_Nin.shape[1]), w_Ein_out).view(x_Nin.shape[0], -1)
    aligned = all((s * x_Nin.element_size()) % 16 == 0 for s in w_Ein_out.shape[1:])
    if (x_Nin.device.type == "cpu" or x_Nin.dtype == torch.bfloat16) and aligned:
        if x_Nin.dtype != torch.bfloat16 and torch.compiler.is_compiling():
            # torch compiles _grouped_mm for bf16 only. Without autograd (a decode step) an op the compiler
            # keeps whole, so the graph holds; recording autograd, a graph break to the eager op and its backward
            if torch.is_grad_enabled() and (x_Nin.requires_grad or w_Ein_out.requires_grad):
                return _grouped_mm_eager(x_Nin, w_Ein_out, offs_E)
            return grouped_mm_opaque(x_Nin, w_Ein_out, offs_E)
        return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)
    outs, start = [], 0
    for e, end in enumerate(offs_E.tolist()):  # rows start..end belong to expert e (empty when equal)
        outs.append(x_Nin[start:end] @ w_Ein_out[e])
        start = end
    # rows past the last offset belong to no expert (capacity_experts' padding): zeros, so the output keeps N rows
    outs.append(x_Nin.new_zeros(x_Nin.shape[0] - start, w_Ein_out.shape[2]))
    return torch.cat(outs)


@torch.library.custom_op("everyprompt::grouped_mm", mutates_args=())
def grouped_mm_opaque(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as one op opaque to torch.compile (no autograd): a no-grad compiled forward in fp32
    keeps one graph where _grouped_mm's own meta function takes bf16 only."""
    return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)


@grouped_mm_opaque.register_fake
def _grouped_mm_opaque_shape(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return x_Nin.new_empty(x_Nin.shape[0], w_Ein_out.shape[2])  # (N, out)


@torch.compiler.disable
def _grouped_mm_eager(x_Nin: torch.Tensor, w_Ein_out: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm run eagerly: a graph break inside torch.compile'd blocks."""
    return torch._grouped_mm(x_Nin, w_Ein_out, offs=offs_E)


class GatherRows(torch.autograd.Function):
    """`GatherRows.apply(x, index, inverse, reps)` = x[index], where index takes every row of x exactly
    `reps` times and `inverse` undoes it: x[index][inverse] lists row i's copies at i*reps .. i*reps+reps-1.

    Sorting a MoE layer's (token, expert) pairs by expert and back are permutations, so the backward
    is a gather too (through `inverse`, then a sum of each row's copies), where autograd would
    scatter-add (index_add: atomics on GPU, so not bitwise repeatable).
    """

    @staticmethod
    def forward(ctx, x, index, inverse, reps: int):
        ctx.save_for_backward(inverse)
        ctx.reps = reps
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        g = g.index_select(0, inverse)  # (rows * reps, D): row i's copies now consecutive
        return (g.view(-1, ctx.reps, g.shape[-1]).sum(1) if ctx.reps > 1 else g), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, reps: int) -> torch.Tensor:
    """x[index] (rows); through `GatherRows` when autograd records, plain `index_select` otherwise (decoding)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return GatherRows.apply(x, index, inverse, reps)
    return x.index_select(0, index)
