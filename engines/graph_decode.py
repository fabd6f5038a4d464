"""The continuous-batching decode step captured in a CUDA graph (engine.cuda_graph): `GraphedDecode`, one call's
step (batching.decode_rows) captured once in a torch.cuda.CUDAGraph and replayed at every later step, and
`make_decode_step`, which gives it or the eager step. Needs CUDA; has not run on a GPU.

A decode step is a few hundred small kernels whose launches, more than their arithmetic, can bound its time; a
replay launches them all at once. Shapes as in model.py, with batching.py's B (a slot) and W (the columns a step
attends), and S, the call's cache columns.

Choices:
1. One shape per call, the step's W padded to S: the step's bias gets -inf on columns [W, S), so a row attends
   what it attends eagerly, over a longer reduction (its numbers differ from the eager step's over W columns by
   float rounding, as continuous batching's already differ from the static engine's). Not W buckets (a graph
   per power of two): under expert parallelism each rank has its own W (and S), and a rank capturing a new
   bucket runs eager warm-up steps, each with its all-to-alls, while another rank replays; the ranks would meet
   in different collectives. One capture, at a call's first step, which every rank takes at the same step,
   keeps them in lockstep. The cost: every step's attention reads all S columns of the cache (a paged cache
   gathers every page of a slot's table).
2. Captured at the first call, on that call's inputs: WARMUP eager steps on a side stream first (the recipe of
   PyTorch's CUDA semantics notes, section CUDA Graphs: lazy initialisation, library handles and workspaces, and
   kernel choices happen outside the capture), then the capture on that same stream (handles are cached per
   stream: PyTorch's make_graphed_callables warms up and captures on one stream for that reason), then a replay,
   which gives the step's result. A warm-up step writes what the step writes (the same tokens' keys, values and
   routes at the same columns), so the cache ends as after one step.
3. tokens_B, col_B and the bias are copied into static buffers; the cache and the routes buffer are the call's
   own tensors, written in place by the graph. The logits come back in the graph's output tensor, which the
   next replay overwrites: sample from them before the next step.
4. The step must not sync with the host (a capture refuses it): bf16 grouped GEMMs (ops.grouped_mm takes
   device offsets in bf16; in fp32 on CUDA it reads them on the host), and under expert parallelism
   ep_decode.capacity_dispatch around every call (the graph keeps the path its capture took). The all-to-alls
   are captured with the rest (NCCL >= 2.9 captures collectives; a capture and each launch are collective, so
   every rank of the ep group captures at the same step and replays at every step, as choice 1 has them);
   FSDP's forward hooks run at the capture only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from model import KVCache
    from paged_kv import PagedKVCache

WARMUP = 3
"""Eager steps on a side stream before the capture: PyTorch's CUDA graph example warms up with 3."""


class GraphedDecode:
    """A continuous-batching call's decode step in a CUDA graph, for the call's B slots and S cache columns
    (choice 1); called as the eager step is, (tokens_B [B] int64, col_B [B] int64, bias_B11W [B, 1, 1, W] fp32)
    -> logits [B, V] fp32, W <= S. Needs CUDA; has not run on a GPU.

    step: batching.decode_rows, passed in (this file sits below batching.py, which calls it). cache (model.KVCache
    or paged_kv.PagedKVCache, whose page table the graph reads where it lies, so a page given between steps is
    seen) and routes_BSLK [B, S, L, K]: the call's, which the graph writes in place (choice 3).
    Raises ValueError, naming engine.cuda_graph, off CUDA or outside bf16 (choice 4).
    """

    def __init__(self, step: Callable, model: nn.Module, cache: KVCache | PagedKVCache, routes_BSLK: torch.Tensor):
        device, dtype = cache.k.device, cache.k.dtype
        if device.type != "cuda":
            raise ValueError(f"engine.cuda_graph=True captures the decode step in a CUDA graph, but the engine runs "
                             f"on {device}; set device='cuda' or engine.cuda_graph=False")
        if dtype != torch.bfloat16:
            raise ValueError(f"engine.cuda_graph=True needs dtype='bfloat16' (the experts' grouped GEMMs in {dtype} "
                             f"read their offsets on the host, which a capture refuses); got {dtype}")
        self.step, self.model, self.cache, self.routes_BSLK = step, model, cache, routes_BSLK
        B, S = routes_BSLK.shape[:2]  # (B, S, L, K): the call's slots and columns, whichever cache holds them
        self.tokens_B = torch.zeros(B, dtype=torch.long, device=device)
        self.col_B = torch.zeros(B, dtype=torch.long, device=device)
        self.bias_B11S = torch.zeros(B, 1, 1, S, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None  # the graph's output, overwritten by each replay
        self.captures = 0

    def __call__(self, tokens_B: torch.Tensor, col_B: torch.Tensor, bias_B11W: torch.Tensor) -> torch.Tensor:
        W = bias_B11W.shape[-1]
        self.tokens_B.copy_(tokens_B)
        self.col_B.copy_(col_B)
        self.bias_B11S[..., :W].copy_(bias_B11W)
        self.bias_B11S[..., W:] = float("-inf")  # columns past the window: no row attends them (choice 1)
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.logits_BV

    @torch.no_grad()
    def capture(self):
        """WARMUP eager steps on a side stream, then the capture (choice 2); the caller replays it."""
        def run():
            return self.step(self.model, self.tokens_B, self.cache, self.routes_BSLK, self.col_B, self.bias_B11S)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # the static inputs' copies come first
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.logits_BV = run()
        self.captures += 1


def make_decode_step(step: Callable, model: nn.Module, cache: KVCache | PagedKVCache, routes_BSLK: torch.Tensor, *,
                cuda_graph: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """One continuous-batching call's decode step, (tokens_B, col_B, bias_B11W) -> logits [B, V] fp32, writing
    `cache` and `routes_BSLK`: a `GraphedDecode` when cuda_graph (engine.cuda_graph), else `step` run eagerly.
    Raises ValueError (GraphedDecode's) when cuda_graph is set off CUDA or outside bf16."""
    if cuda_graph:
        return GraphedDecode(step, model, cache, routes_BSLK)
    return lambda tokens_B, col_B, bias_B11W: step(model, tokens_B, cache, routes_BSLK, col_B, bias_B11W)
