"""The policy's weights on the move, to an engine, a checkpoint or an HF export, and in blockwise FP8.

`policy_tensors` names a model's tensors (a tied one once), `full_tensor` gathers a sharded one whole,
`local` is this rank's shard, `weight_buckets` cuts a stream of tensors into bounded transfers (weight
sync, hf.save_hf's shards); a DTensor is recognised by its methods, no torch.distributed import.
Blockwise FP8 after DeepSeek-V3 (arXiv 2412.19437, section 3.3): the native engine's FP8 modules
(`to_fp8_modules`), the blockwise quantiser and its inverse, and the trainer side of an FP8 weight
sync (`quantize_fp8`, our names or HF's: what SGLang's FP8 serving loads).

Notable choices:

1. Blockwise e4m3 with one fp32 scale per 128x128 block of each attention and expert
   (routed, shared, dense FFN) matrix, activations quantised per token in 1x128 tiles when
   used (dynamic); the router gate, embeddings, lm_head and norms stay in high precision.
2. A matmul uses `torch._scaled_mm` where it supports blockwise scales (Hopper GPUs, dims
   multiples of 128), else dequantise-then-matmul in the engine dtype (CPU, and the experts
   everywhere: torch 2.13 has no blockwise grouped FP8 GEMM), which gives the same numbers
   up to accumulation order.
3. Scales are stored as their inverse (`<name>_scale_inv`, multiply to dequantise),
   DeepSeek-V3's checkpoint convention that SGLang loads. The trainer quantises before
   sending (`quantize_fp8`).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import GroupedExperts, ModelConfig, Transformer
from ops import grouped_mm, swiglu

Named = Iterable[tuple[str, torch.Tensor]]
"""(name, tensor) pairs under state-dict names: what a weight sync or an export takes."""
DEFAULT_BUCKET_BYTES = 512 << 20
"""Weight-sync bucket: bounds the staging memory and sets the size of one transfer."""


def policy_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied lm_head once, as the embedding) and persistent buffer (GLM-4.5's
    expert_bias) of a model, detached, under its state-dict names: what an engine, a checkpoint or
    an HF export takes. Sharded parameters come as their local DTensors (`full_tensor` gathers)."""
    seen = set()
    # state_dict names drop activation checkpointing's wrapper and leave out non-persistent buffers
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied weight appears under both its names: send it once
            seen.add(id(t))
            yield name, t.detach()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank of its mesh must call it), else t, detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def weight_buckets(named_tensors: Named, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most bucket_bytes each (a larger tensor alone), in order."""
    bucket, size = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:  # `bucket and`: never an empty bucket; a larger tensor goes alone
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (t itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


# ----------------------------------------------------------------------------- blockwise FP8

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3 has 4 exponent bits, 3 mantissa bits (OCP FP8 spec)
WEIGHT_BLOCK = (128, 128)  # one scale per 128x128 tile of a weight matrix (DeepSeek-V3)
ACT_BLOCK = (1, 128)  # one scale per token per 128 input features (dynamic activations)
_AMAX_FLOOR = 1e-12  # an all-zero block gets a tiny scale instead of dividing by zero

# Which of our tensors are FP8 (everything else stays in high precision), and the same in HF names.
# Our fused matrices (wqkv; w13 = gate | up) are quantised fused, HF's separately: the 128x128 blocks, and so the
# values, agree when each part's size (q, k, v rows; the gate and up widths) is a multiple of 128.
FP8_TARGETS = re.compile(r"layers\.\d+\.(attn\.(wqkv|wo)\.weight|mlp\.experts\.w(13|2)|mlp\.(shared\.)?w(13|2)\.weight)")
HF_FP8_TARGETS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_experts\.)?"
                            r"(gate|up|down)_proj)\.weight")


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values (w's shape) and fp32 inverse scales [..., ceil(rows/br), ceil(cols/bc)] of the last two dims.

    Each block is scaled so its largest |value| maps to 448, e4m3's largest finite value;
    dequantise with `dequantize_fp8_blockwise`. Partial edge blocks are padded with zeros.
    """
    *lead, R, C = w.shape  # rows and columns of the matrix (local names, not the legend's R and C)
    br, bc = block
    nr, nc = -(-R // br), -(-C // bc)  # ceil division: a partial edge block gets its own scale
    padded = F.pad(w.float(), (0, nc * bc - C, 0, nr * br - R))  # zeros right and below never raise a block's amax
    tiles = padded.view(*lead, nr, br, nc, bc)  # (..., nr, br, nc, bc)
    # (..., nr, 1, nc, 1): block amax / 448, the multiplier that dequantises (stored as DeepSeek-V3's scale_inv)
    scale = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    # the clamp guards against rounding past 448: the cast to e4m3fn does not saturate (an overflow becomes NaN)
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(*lead, nr * br, nc * bc)[..., :R, :C]  # padding cut
    return q.contiguous(), scale.view(*lead, nr, nc)  # the cut is a strided view; scales (..., nr, nc)


def dequantize_fp8_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8_blockwise`: q * scale of its block, in `dtype`."""
    R, C = q.shape[-2:]
    # each block's scale repeated over its rows, then its columns, edge blocks cut to the matrix: (..., R, C)
    s = scale_inv.repeat_interleave(block[0], dim=-2)[..., :R, :].repeat_interleave(block[1], dim=-1)[..., :C]
    return (q.float() * s).to(dtype)  # e4m3 -> fp32 is exact; the product is taken in fp32, then cast to dtype


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x quantised to e4m3 per token in 1x128 tiles and back: the numbers an FP8 GEMM sees."""
    return dequantize_fp8_blockwise(*quantize_fp8_blockwise(x, ACT_BLOCK), ACT_BLOCK, x.dtype)


_scaled_mm_broken = False  # set once _scaled_mm has refused blockwise scales on this machine


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype, w_dequantized: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T [..., out] in `dtype`, for W [out, in] stored blockwise-FP8 (w_q e4m3,
    w_scale_inv fp32 per 128x128 block), activations quantised per token in 1x128 tiles.

    `torch._scaled_mm` on Hopper when both dims are multiples of 128; elsewhere the
    activations are quantised and dequantised and multiplied by the dequantised weight
    (w_dequantized when given, saving the per-call dequantisation), which gives the same
    numbers up to accumulation order.
    """
    global _scaled_mm_broken
    x_Nin = x.reshape(-1, x.shape[-1])  # (N, in): every leading dim indexes tokens
    x_q, x_s = quantize_fp8_blockwise(x_Nin, ACT_BLOCK)  # (N, in) e4m3 and (N, ceil(in/128)), from this call's values
    y = None
    out_f, in_f = w_q.shape
    # the Hopper (sm_90) blockwise path only, with no partial 128-wide blocks; every other case takes the fallback
    if (x.is_cuda and not _scaled_mm_broken and torch.cuda.get_device_capability(x.device) == (9, 0)
            and in_f % 128 == 0 and out_f % 128 == 0):
        # w_q.t() is W^T [in, out] in column-major memory, the layout _scaled_mm's second operand needs; the
        # activation scales keep their shape (N, in/128) with column-major strides (the .t().contiguous().t())
        try:  # cuBLAS blockwise (1x128 x 128x128) scaling on Hopper; activation scales outer-dim-major
            y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s.t().contiguous().t(), scale_b=w_scale_inv.t(), out_dtype=dtype)
        except (RuntimeError, NotImplementedError):
            _scaled_mm_broken = True  # this torch / cuBLAS build refuses them: the fallback for the rest of the run
    if y is None:
        w = w_dequantized if w_dequantized is not None else dequantize_fp8_blockwise(w_q, w_scale_inv, dtype=dtype)
        y = F.linear(dequantize_fp8_blockwise(x_q, x_s, ACT_BLOCK, dtype), w)  # (N, out) from FP8-rounded inputs
    if bias is not None:
        y = y + bias  # the bias is never quantised
    return y.view(*x.shape[:-1], out_f)  # (..., out)


class FP8Linear(nn.Module):
    """Drop-in for nn.Linear with weight [out, in] in e4m3 and weight_scale_inv [ceil(out/128), ceil(in/128)]."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        out_f, in_f = linear.weight.shape
        dev = linear.weight.device
        self.dtype = dtype  # the engine dtype: what the dequantised weight and the output are in
        # Buffers, not parameters: the engine never trains. Named as in an HF FP8 checkpoint, so a weight's scale
        # is its name + "_scale_inv", what quantize_fp8 sends; zeros and ones until update_weights loads values.
        self.register_buffer("weight", torch.zeros(out_f, in_f, dtype=FP8, device=dev))
        self.register_buffer("weight_scale_inv", torch.ones(-(-out_f // 128), -(-in_f // 128), device=dev))
        self.bias = linear.bias  # kept in high precision
        self.dequantized = None  # the weight dequantised once per weight update (`refresh`)

    def refresh(self):
        """Cache the dequantised weight (call after loading new values)."""
        self.dequantized = dequantize_fp8_blockwise(self.weight, self.weight_scale_inv, dtype=self.dtype)

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.dtype, self.dequantized)


class FP8GroupedExperts(nn.Module):
    """Drop-in for model.GroupedExperts: w13 [E, D, 2I] and w2 [E, I, D] in e4m3 with 128x128-block inverse scales."""

    def __init__(self, experts: GroupedExperts, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        for name, w in (("w13", experts.w13), ("w2", experts.w2)):
            E, R, C = w.shape  # experts, then each matrix's rows and columns ([in, out]: not the legend's R and C)
            # blocks over the last two dims of each expert's matrix; names as FP8_TARGETS + "_scale_inv"
            self.register_buffer(name, torch.zeros(E, R, C, dtype=FP8, device=w.device))
            self.register_buffer(f"{name}_scale_inv", torch.ones(E, -(-R // 128), -(-C // 128), device=w.device))
        self.dequantized = None

    def refresh(self):
        """Cache the dequantised weights (call after loading new values): torch 2.13 has no
        blockwise-scaled grouped GEMM, so experts always run dequantise-then-matmul."""
        self.dequantized = (dequantize_fp8_blockwise(self.w13, self.w13_scale_inv, dtype=self.dtype),
                            dequantize_fp8_blockwise(self.w2, self.w2_scale_inv, dtype=self.dtype))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) dequantised to the engine dtype."""
        if self.dequantized is None:
            self.refresh()
        return self.dequantized

    def forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (counts_e rows each) -> expert outputs, as GroupedExperts.forward."""
        w13, w2 = self.weights()
        offs = counts_e.cumsum(0).to(torch.int32)  # (E,) end row of each expert's rows, as grouped_mm takes them
        # each GEMM's input rounded per token in 1x128 tiles, as an FP8 grouped GEMM would see it
        h = swiglu(grouped_mm(fake_quantize_activations(x_RD), w13, offs))  # (R, I)
        return grouped_mm(fake_quantize_activations(h), w2, offs)  # (R, D)


def to_fp8_modules(model: Transformer, dtype: torch.dtype) -> Transformer:
    """Swap every FP8_TARGETS matrix of `model` for its FP8 module, in place (values zero until loaded)."""
    for block in model.layers:
        for name in ("wqkv", "wo"):
            setattr(block.attn, name, FP8Linear(getattr(block.attn, name), dtype))
        # a dense block's FFN, or a MoE block's shared expert if it has one; the router gate stays high precision
        ffns = [block.mlp] if not block.is_moe else ([block.mlp.shared] if block.mlp.shared is not None else [])
        for ffn in ffns:
            ffn.w13, ffn.w2 = FP8Linear(ffn.w13, dtype), FP8Linear(ffn.w2, dtype)
        if block.is_moe:
            block.mlp.experts = FP8GroupedExperts(block.mlp.experts, dtype)
    return model


def sglang_ep(cfg: ModelConfig, tp: int) -> int:
    """The expert parallel of an SGLang server on `tp` GPUs for this model: all of them where they divide the
    routed experts (SGLang splits experts evenly: fused_moe_triton/layer.py asserts it), else 1. What
    build_sglang_engine launches and the README's commands pass as --ep-size, and what fp8_bf16_modules assumes."""
    return tp if cfg.num_experts % tp == 0 else 1


def fp8_bf16_modules(cfg: ModelConfig, tp: int) -> list[str]:
    """HF names of the linear modules a blockwise-FP8 SGLang server on `tp` GPUs (expert parallel `sglang_ep`)
    cannot hold in FP8. They stay bf16: hf.save_hf lists them as the checkpoint's ignored_layers (which SGLang
    serves unquantised), and the FP8 weight sync sends them bf16.

    SGLang's rule (sglang 0.5.21, layers/quantization/fp8.py, Fp8LinearMethod.validate_block_quant_shapes), with
    128-wide blocks: each part one GPU holds of a fused column-parallel module (q|k|v, gate|up) is whole blocks,
    even on one GPU; on several, so is each GPU's share of a row-parallel module's inputs (o_proj, down_proj).
    Key/value heads fewer than tp are copied, one head a GPU (layers/linear.py, QKVParallelLinear). The dense MLP
    and a shared expert are tensor parallel over all tp GPUs (models/glm4_moe.py; under expert parallelism
    GLM-4.5's shared expert is not fused into the routed ones). Routed experts cannot stay bf16 one by one: their
    width on each GPU of the MoE's tensor parallel (tp / ep) must be whole blocks (Fp8MoEMethod.create_weights),
    or ValueError. GLM-4.5-Air at tp 8 (ep 8): the dense MLP (10944 / 8 = 1368) and the shared expert (1408 / 8 =
    176) stay bf16; attention (12 query heads and one key/value head of 128 a GPU) and the experts (1408 wide,
    each whole on one GPU) are FP8; on one GPU its dense MLP's gate and up (10944 wide) stay bf16."""
    block = WEIGHT_BLOCK[0]

    def whole(width: int, ways: int) -> bool:  # width split `ways` ways, each share whole blocks
        return width % ways == 0 and width // ways % block == 0
    ep = sglang_ep(cfg, tp)
    if not whole(cfg.moe_inter_dim, tp // ep):
        raise ValueError(f"engine.fp8 on {tp} GPUs (expert parallel {ep}): the routed experts' width "
                         f"{cfg.moe_inter_dim} split {tp // ep} ways is not whole {block}-wide blocks, which SGLang's "
                         f"blockwise FP8 refuses; serve this model in bf16 (engine.fp8=false)")
    q_width = cfg.n_heads * cfg.head_dim
    kv_ok = whole(cfg.n_kv_heads * cfg.head_dim, tp) if cfg.n_kv_heads >= tp else cfg.head_dim % block == 0
    names = []
    for i in range(cfg.n_layers):
        attn = f"model.layers.{i}.self_attn"
        if not (whole(q_width, tp) and kv_ok):  # q|k|v are one fused module: all bf16 or none
            names += [f"{attn}.{p}_proj" for p in "qkv"]
        if tp > 1 and not whole(q_width, tp):  # o_proj's inputs are the query heads
            names.append(f"{attn}.o_proj")
        dense = i < cfg.first_k_dense_replace
        width = cfg.dense_inter_dim if dense else cfg.num_shared_experts * cfg.moe_inter_dim
        mlp = f"model.layers.{i}.mlp" + ("" if dense else ".shared_experts")
        if width and not whole(width, tp):  # gate|up fused, column-parallel; down row-parallel over the same width
            names += [f"{mlp}.gate_proj", f"{mlp}.up_proj"] + ([f"{mlp}.down_proj"] if tp > 1 else [])
    return names


def quantize_fp8(named_tensors: Named, *, hf: bool = False, bf16: Iterable[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainer side of the FP8 weight sync: each FP8 target becomes (name, e4m3) and
    (name + "_scale_inv", fp32 scales), quantised in 128x128 blocks of its last two dims;
    other tensors pass through, and so do the modules `bf16` names (`fp8_bf16_modules`). hf=True
    matches HF hub names (expert weights [out, in]), whose inverse scales SGLang reads as
    `<...>.weight_scale_inv`. Lazy: one tensor at a time.
    """
    targets, kept = HF_FP8_TARGETS if hf else FP8_TARGETS, set(bf16)
    for name, t in named_tensors:
        if targets.fullmatch(name) and t.dtype != FP8 and name.removesuffix(".weight") not in kept:
            q, s = quantize_fp8_blockwise(t.detach())
            yield name, q
            yield name + "_scale_inv", s  # the name FP8Linear, FP8GroupedExperts and SGLang read the scale under
        else:
            yield name, t
