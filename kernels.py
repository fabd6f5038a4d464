"""Compute kernels the model calls, where torch's own ops would do work the model does not need.

- `grouped_mm`: one GEMM per expert over rows sorted by expert (`torch._grouped_mm` where
  it applies, else an exact per-expert loop).
- `swiglu_experts`: a MoE layer's SwiGLU experts, x -> swiglu(x W13) W2 per expert. Through
  torch that is three passes over the routed rows in memory (grouped GEMM, SwiGLU, grouped
  GEMM; more in the backward). On CPU in fp32 it is kernels.c's fused loop instead: each
  expert's rows a block at a time, SwiGLU while the block is in cache, its output never
  stored (recomputed in the backward from the saved x W13).
- `combine`: a MoE layer's weighted sum over each token's K expert outputs, read back
  through the inverse of the sort by expert; on CPU in fp32 kernels.c's single pass (no
  [N*K, D] gather, product and sum in memory), elsewhere `gather_rows` and a weighted sum.
- `GatherRows`: a row gather whose backward is a gather too. Sorting a MoE layer's
  (token, expert) pairs by expert and back are permutations; autograd would differentiate
  `x[index]` with a scatter-add (index_put with accumulate; atomic adds once inductor
  compiles it for CPU, several times the gather's cost; bench/model.py).
- `causal_attention`: causal scaled dot-product attention. On CUDA it is
  `F.scaled_dot_product_attention`, whose flash kernels skip the masked upper triangle.
  torch 2.13's CPU flash kernel does not: it walks keys in blocks of 512 and computes a
  block whole even where the causal mask removes it, so at T <= 512 a causal call costs
  what a full one does. On CPU it is kernels.c's instead (FlashAttention-2, arXiv
  2307.08691, with each query block stopped at its causal frontier: 0.53 of the scores at
  T = 512).

kernels.c is compiled on first use with the system C compiler (as torch.compile's CPU
backend also needs) into a per-CPU cache and called through ctypes, the GIL released; it
runs on torch's OpenMP threads and the BLAS torch links (MKL). Where it cannot be built
(no compiler, a BLAS other than MKL) the torch paths run, with a warning.

Shape legend: B batch, H query heads, J kv heads, T tokens, d head dim, N rows, E experts,
R routed rows (grouped by expert), D model dim, I expert hidden dim.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import warnings

import torch
import torch.nn.functional as F

CPU_ATTENTION_BLOCK = 32
"""Query rows per block of the CPU attention kernel: smaller blocks waste less of the diagonal
(half a block per block row) but make thinner GEMMs (bench/model.py picked 32)."""
CPU_ATTENTION_MIN_TOKENS = 384
"""Shorter sequences take SDPA: there torch's flash kernel, whose one 512-key block then spans
the whole row, is as fast."""
CPU_ATTENTION_KEY_CHUNK = 512
"""Keys per chunk of the CPU kernel's online softmax: bounds its buffers to (H/J * 32) x 512 floats."""
CPU_EXPERT_ROW_BLOCK = 256
"""Rows of an expert the CPU kernel takes at a time: a block's x W13 (256 x 2I floats, 512 KB at
I = 256) stays in L2 for its SwiGLU."""
CPU_KERNELS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp")


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] along the last dim (arXiv 2002.05202)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_experts(x_RD: torch.Tensor, w13_EDI: torch.Tensor, w2_EID: torch.Tensor,
                   counts_E: torch.Tensor) -> torch.Tensor:
    """swiglu(x W13[e]) W2[e] for rows grouped by expert (counts_E rows each, in expert order) [R, D].

    w13_EDI: [E, D, 2I] (gate | up), w2_EID: [E, I, D]. On CPU in fp32, kernels.c's fused
    loop (see the module docstring); elsewhere two grouped GEMMs around `swiglu`.
    """
    if x_RD.device.type == "cpu" and x_RD.dtype == w13_EDI.dtype == w2_EID.dtype == torch.float32:
        return _cpu_swiglu_experts(x_RD, w13_EDI, w2_EID, counts_E)
    return _torch_swiglu_experts(x_RD, w13_EDI, w2_EID, counts_E)


def _torch_swiglu_experts(x_RD, w13_EDI, w2_EID, counts_E) -> torch.Tensor:
    offs = counts_E.cumsum(0).to(torch.int32)
    return grouped_mm(swiglu(grouped_mm(x_RD, w13_EDI, offs)), w2_EID, offs)  # (R, 2I) -> (R, I) -> (R, D)


def combine(out_RD: torch.Tensor, inverse_R: torch.Tensor, order_R: torch.Tensor,
            weights_NK: torch.Tensor) -> torch.Tensor:
    """sum_k weights[n, k] out[inverse[n*K + k]] [N, D] fp32: expert outputs in expert order back to tokens.

    inverse_R (int64) maps each (token, k) pair n*K + k to its row of out_RD; order_R is its
    inverse permutation (row -> pair); weights_NK fp32. On CPU in fp32, kernels.c's one pass;
    elsewhere `gather_rows` then a weighted sum in fp32.
    """
    if out_RD.device.type == "cpu" and out_RD.dtype == torch.float32:
        return _cpu_combine(out_RD, inverse_R, order_R, weights_NK)
    return _torch_combine(out_RD, inverse_R, order_R, weights_NK)


def _torch_combine(out_RD, inverse_R, order_R, weights_NK) -> torch.Tensor:
    N, K = weights_NK.shape
    out_NKD = gather_rows(out_RD, inverse_R, order_R, 1).view(N, K, -1)  # (token, k) order
    return (out_NKD.float() * weights_NK[..., None]).sum(1)


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
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        g = g.index_select(0, inverse)
        return (g.view(-1, ctx.reps, g.shape[-1]).sum(1) if ctx.reps > 1 else g), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, reps: int) -> torch.Tensor:
    """x[index] (rows); through `GatherRows` when autograd records, plain `index_select` otherwise
    (no autograd.Function overhead in no-grad forwards such as decoding). index_select, not
    x[index]: torch 2.13's CPU advanced indexing copies element by element, slower for rows."""
    if torch.is_grad_enabled() and x.requires_grad:
        return GatherRows.apply(x, index, inverse, reps)
    return x.index_select(0, index)


def causal_attention(q_BHTd: torch.Tensor, k_BJTd: torch.Tensor, v_BJTd: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v [B, H, T, d] in q's dtype; GQA when J < H.

    On CPU from CPU_ATTENTION_MIN_TOKENS tokens, kernels.c's (in fp32: other dtypes are cast
    to it and back) where it could be built; elsewhere `F.scaled_dot_product_attention`.
    """
    if q_BHTd.device.type == "cpu" and q_BHTd.shape[2] >= CPU_ATTENTION_MIN_TOKENS:
        return _cpu_causal(q_BHTd, k_BJTd, v_BJTd)
    return _sdpa_causal(q_BHTd, k_BJTd, v_BJTd)


def _sdpa_causal(q_BHTd, k_BJTd, v_BJTd) -> torch.Tensor:
    return F.scaled_dot_product_attention(q_BHTd, k_BJTd, v_BJTd, is_causal=True,
                                          enable_gqa=q_BHTd.shape[1] != k_BJTd.shape[1])


@functools.lru_cache(maxsize=None)
def _cpu_lib() -> ctypes.CDLL | None:
    """kernels.c compiled and loaded, bound to torch's own MKL; None (warned once) where it cannot be."""
    try:
        libtorch = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*"))[0])
        sgemm, local_threads = libtorch.sgemm_, libtorch.mkl_set_num_threads_local  # AttributeError without MKL
        lib = ctypes.CDLL(_build(CPU_KERNELS_SOURCE))
    except (OSError, IndexError, AttributeError, subprocess.CalledProcessError) as e:
        failed_build = isinstance(e, subprocess.CalledProcessError)
        detail = (e.stderr or b"").decode(errors="replace")[-500:] if failed_build else ""
        warnings.warn(f"CPU kernels (kernels.c) unavailable ({type(e).__name__}: {e} {detail}); using torch's ops: "
                      "SDPA, which computes the masked half of every 512-key block, and grouped GEMMs")
        return None
    lib.kernels_init(ctypes.cast(sgemm, ctypes.c_void_p), ctypes.cast(local_threads, ctypes.c_void_p))
    return lib


def _build(source: str) -> str:
    """Compile a C file to a shared library in the cache (once per source, flags, compiler and CPU); its path."""
    configured = (sysconfig.get_config_var("CC") or "cc").split()[0]  # the compiler Python was built with
    cc = os.environ.get("CC") or (configured if shutil.which(configured) else "cc")
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # -march=native code is only valid on CPUs with these flags
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith(("flags", "Features"))), "")
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + repr((cc, _CFLAGS, cpu)).encode()).hexdigest()[:16]
    cache = os.environ.get("EVERYPROMPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "everyprompt")
    path = os.path.join(cache, f"{os.path.splitext(os.path.basename(source))[0]}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        # -ffast-math only when compiling: linking a shared library with it can set flush-to-zero for the process
        subprocess.run([cc, *_CFLAGS, "-c", source, "-o", tmp + ".o"], check=True, capture_output=True)
        subprocess.run([cc, "-shared", "-fopenmp", tmp + ".o", "-o", tmp, "-lm"], check=True, capture_output=True)
        os.remove(tmp + ".o")
        os.replace(tmp, path)  # atomic: ranks building at once each write their own tmp
    return path


def _run(kernel: str, *args):
    """Call a kernels.c entry point; it returns nonzero when no worker could allocate its scratch buffer."""
    if getattr(_cpu_lib(), kernel)(*args):
        raise RuntimeError(f"kernels.c {kernel}: out of memory for its scratch buffers; outputs incomplete")


def _strides(x: torch.Tensor):
    return (ctypes.c_int64 * 3)(*x.stride()[:3])


def _ptr(x: torch.Tensor):
    return ctypes.c_void_p(x.data_ptr())


class _CPUCausalAttention(torch.autograd.Function):
    """kernels.c's attention forward (saving each row's log-sum-exp) and backward, fp32, last dims contiguous."""

    @staticmethod
    def forward(ctx, q_BHTd, k_BJTd, v_BJTd):
        B, H, T, d = q_BHTd.shape
        J = k_BJTd.shape[1]
        out_BHTd = q_BHTd.new_empty(B, T, H, d).transpose(1, 2)  # the caller's transpose back is then a view
        lse_BHT = q_BHTd.new_empty(B, H, T)
        _run(
            "attn_fwd", B, H, J, T, d, CPU_ATTENTION_BLOCK, CPU_ATTENTION_KEY_CHUNK, ctypes.c_float(d ** -0.5),
            torch.get_num_threads(), _ptr(q_BHTd), _strides(q_BHTd), _ptr(k_BJTd), _strides(k_BJTd),
            _ptr(v_BJTd), _strides(v_BJTd), _ptr(out_BHTd), _strides(out_BHTd), _ptr(lse_BHT))
        ctx.save_for_backward(q_BHTd, k_BJTd, v_BJTd, out_BHTd, lse_BHT)
        return out_BHTd

    @staticmethod
    def backward(ctx, grad_BHTd):
        q, k, v, out, lse = ctx.saved_tensors
        grad_BHTd = grad_BHTd if grad_BHTd.stride(-1) == 1 else grad_BHTd.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        B, H, T, d = q.shape
        _run(
            "attn_bwd", B, H, k.shape[1], T, d, CPU_ATTENTION_BLOCK, CPU_ATTENTION_KEY_CHUNK, ctypes.c_float(d ** -0.5),
            torch.get_num_threads(), _ptr(grad_BHTd), _strides(grad_BHTd), _ptr(q), _strides(q), _ptr(k),
            _strides(k), _ptr(v), _strides(v), _ptr(out), _strides(out), _ptr(lse), _ptr(dq), _strides(dq),
            _ptr(dk), _strides(dk), _ptr(dv), _strides(dv))
        return dq, dk, dv


@torch.compiler.disable
def _cpu_causal(q_BHTd, k_BJTd, v_BJTd) -> torch.Tensor:
    """Runs eagerly inside torch.compile'd blocks (a graph break); fp32 in and out of the kernel."""
    if _cpu_lib() is None:
        return _sdpa_causal(q_BHTd, k_BJTd, v_BJTd)
    dtype = q_BHTd.dtype
    q, k, v = (x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in (q_BHTd, k_BJTd, v_BJTd))
    return _CPUCausalAttention.apply(q, k, v).to(dtype)


class _CPUSwiGLUExperts(torch.autograd.Function):
    """kernels.c's fused experts, forward (keeping x W13 only when a gradient will be asked) and backward."""

    @staticmethod
    def forward(ctx, x_RD, w13_EDI, w2_EID, counts_E):
        R, D = x_RD.shape
        E, I = w2_EID.shape[:2]
        h_RI = x_RD.new_empty(R, 2 * I) if any(ctx.needs_input_grad[:3]) else None
        y_RD = x_RD.new_empty(R, D)
        _run("experts_fwd", E, D, I, CPU_EXPERT_ROW_BLOCK, _ptr(counts_E), _ptr(x_RD), _ptr(w13_EDI), _ptr(w2_EID),
             _ptr(h_RI) if h_RI is not None else None, _ptr(y_RD), torch.get_num_threads())
        ctx.save_for_backward(x_RD, w13_EDI, w2_EID, counts_E, h_RI)
        return y_RD

    @staticmethod
    def backward(ctx, grad_RD):
        x, w13, w2, counts, h = ctx.saved_tensors
        grad_RD = grad_RD.contiguous()
        dx, dw13, dw2 = torch.empty_like(x), torch.empty_like(w13), torch.empty_like(w2)
        E, I = w2.shape[:2]
        _run("experts_bwd", E, x.shape[1], I, CPU_EXPERT_ROW_BLOCK, _ptr(counts), _ptr(x), _ptr(w13), _ptr(w2),
             _ptr(h), _ptr(grad_RD), _ptr(dx), _ptr(dw13), _ptr(dw2), torch.get_num_threads())
        return dx, dw13, dw2, None


@torch.compiler.disable
def _cpu_swiglu_experts(x_RD, w13_EDI, w2_EID, counts_E) -> torch.Tensor:
    """Runs eagerly inside torch.compile'd blocks (a graph break)."""
    if _cpu_lib() is None:
        return _torch_swiglu_experts(x_RD, w13_EDI, w2_EID, counts_E)
    counts_E = counts_E.to(torch.int64).contiguous()
    assert int(counts_E.sum()) == x_RD.shape[0], "rows must be grouped by expert, counts_E of them each"
    return _CPUSwiGLUExperts.apply(x_RD.contiguous(), w13_EDI.contiguous(), w2_EID.contiguous(), counts_E)


class _CPUCombine(torch.autograd.Function):
    """kernels.c's combine, forward and backward (gradients for the expert outputs and the gate weights)."""

    @staticmethod
    def forward(ctx, out_RD, inverse_R, weights_NK):
        (N, K), D = weights_NK.shape, out_RD.shape[1]
        y_ND = out_RD.new_empty(N, D)
        _run("combine_fwd", N, K, D, _ptr(out_RD), _ptr(inverse_R), _ptr(weights_NK), _ptr(y_ND),
             torch.get_num_threads())
        ctx.save_for_backward(out_RD, inverse_R, weights_NK)
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND):
        out, inverse, weights = ctx.saved_tensors
        grad_ND = grad_ND.contiguous()
        d_out, d_weights = torch.empty_like(out), torch.empty_like(weights)
        (N, K), D = weights.shape, out.shape[1]
        _run("combine_bwd", N, K, D, _ptr(grad_ND), _ptr(out), _ptr(inverse), _ptr(weights), _ptr(d_out),
             _ptr(d_weights), torch.get_num_threads())
        return d_out, None, d_weights


@torch.compiler.disable
def _cpu_combine(out_RD, inverse_R, order_R, weights_NK) -> torch.Tensor:
    """Runs eagerly inside torch.compile'd blocks (a graph break)."""
    if _cpu_lib() is None:
        return _torch_combine(out_RD, inverse_R, order_R, weights_NK)
    return _CPUCombine.apply(out_RD.contiguous(), inverse_R.to(torch.int64).contiguous(),
                             weights_NK.float().contiguous())
