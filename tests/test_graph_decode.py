"""Graph-ready decode (issue 26 item 4): batching.decode_rows, the continuous-batching decode step, traces as one
graph under torch.compile(fullgraph=True) at ep=1 and, under ep_decode.capacity_dispatch, at ep=2 on gloo ranks
(that case in tests/test_ep_decode.py's ranks, step 5, with this file's helpers),
with the eager step's logits, routes and cache bit for bit; on CUDA it is captured in a CUDA graph
(graph_decode.GraphedDecode) whose replays give the eager step's numbers. backend="eager" runs dynamo's graph
with the same ops, so equality is exact; inductor's fused kernels would round differently.
"""
import copy
from contextlib import contextmanager, nullcontext

import pytest
import torch

from engines.batching import decode_rows
from config import load_config
from engines.graph_decode import GraphedDecode, make_decode_step
from model import KVCache, Transformer, route_dtype
from paged_kv import PagedKVCache, pages_for

from test_ep_decode import MODEL  # its model: num_experts=8, top_k=3, a shared expert
S, P = 8, 3  # cache columns of each slot; a page's columns (paged_kv), three pages a slot
CACHES = ["static", "paged"]  # model.KVCache, paged_kv.PagedKVCache (what ContinuousBatch decodes over)


def new_cache(cfg, kind: str, B: int, dtype, device):
    """A cache of B slots of S columns; paged, each slot's pages its own (not in page order, scratch left free)."""
    if kind == "static":
        return KVCache(cfg, B, S, dtype=dtype, device=device)
    cache = PagedKVCache(cfg, B, B * pages_for(S, P), P, S, dtype=dtype, device=device)
    for _ in range(pages_for(S, P)):
        for s in reversed(range(B)):  # a slot's pages interleaved with the others'
            cache.grow(s)
    return cache


def decode_inputs(cfg, B: int, W: int, seed: int, dtype=torch.float32, device="cpu", kind="static"):
    """A decode step's inputs (tokens_B, cache, routes_BSLK, col_B, bias_B11W), the cache's columns filled at random:
    every row at its own column below W, as ContinuousBatch.step builds them."""
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(cfg, kind, B, dtype, device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    routes_BSLK = torch.zeros(B, S, cfg.num_moe_layers, cfg.top_k, dtype=route_dtype(cfg.num_experts), device=device)
    tokens_B = torch.randint(0, cfg.vocab_size, (B,), generator=g).to(device)
    col_B = torch.randint(0, W, (B,), generator=g).to(device)
    col_B[0] = W - 1  # the row that sets the window
    bias_B11W = torch.zeros(B, 1, 1, W, device=device).masked_fill_(
        (torch.arange(W, device=device)[None] > col_B[:, None])[:, None, None], float("-inf"))
    return tokens_B, cache, routes_BSLK, col_B, bias_B11W


def copies(cache, routes_BSLK):
    """A second cache and routes buffer holding the same values, for the second of two runs to write into."""
    other = copy.copy(cache)  # a paged cache's page table shared: the step only reads it
    other.k, other.v = cache.k.clone(), cache.v.clone()
    return other, routes_BSLK.clone()


@contextmanager
def forward_hooks_set_aside(model):
    """Every module's forward hooks removed inside the block, put back after it. FSDP2 runs its hooks outside any
    graph by design (torch wraps each in torch._dynamo.disable: graph breaks around every FSDP unit, each block and
    each router gate); inside distributed.gathered, in fp32, they change no number (the weights are already
    gathered, and no param_dtype asks for a cast), and a CUDA graph's replay never runs them."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, pre, post in saved:
        m._forward_pre_hooks, m._forward_hooks = type(pre)(), type(post)()
    try:
        yield model
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def assert_same_step(model, tokens_B, cache, routes_BSLK, col_B, bias_B11W, *, traced_in=nullcontext()):
    """decode_rows compiled as one graph (inside `traced_in`) gives eager's logits, and writes eager's routes and
    cache, bit for bit."""
    cache2, routes2 = copies(cache, routes_BSLK)
    with torch.no_grad():
        want = decode_rows(model, tokens_B, cache, routes_BSLK, col_B, bias_B11W)
        compiled = torch.compile(decode_rows, fullgraph=True, backend="eager")
        with traced_in:
            got = compiled(model, tokens_B, cache2, routes2, col_B, bias_B11W)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(routes2, routes_BSLK) and routes_BSLK.any()
    assert torch.equal(cache2.k, cache.k) and torch.equal(cache2.v, cache.v)


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_compiles_as_one_graph_with_eager_numbers(dtype, kind):
    # fp32: ops.grouped_mm's op opaque to the compiler; bf16: torch._grouped_mm itself in the graph
    cfg = load_config(None, MODEL).model
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    assert_same_step(model, *decode_inputs(cfg, B=3, W=5, seed=1, dtype=dtype, kind=kind))


def test_a_cuda_graph_is_refused_off_cuda_naming_the_setting():
    cfg = load_config(None, MODEL).model
    _, cache, routes_BSLK, _, _ = decode_inputs(cfg, B=2, W=3, seed=0)
    with pytest.raises(ValueError, match="engine.cuda_graph"):
        GraphedDecode(decode_rows, Transformer(cfg), cache, routes_BSLK)


@pytest.mark.parametrize("overrides,match", [
    (["engine.cuda_graph=true"], "set slots > 0"),
    (["engine.slots=2", "engine.cuda_graph=true"], "needs bf16 on CUDA"),
], ids=["static-engine", "cpu"])
def test_the_cuda_graph_setting_is_refused_without_slots_or_off_cuda_bf16(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_without_a_cuda_graph_the_step_is_decode_rows_itself():
    cfg = load_config(None, MODEL).model
    model = Transformer(cfg)
    tokens_B, cache, routes_BSLK, col_B, bias_B11W = decode_inputs(cfg, B=2, W=3, seed=0)
    cache2, routes2 = copies(cache, routes_BSLK)
    with torch.no_grad():
        want = decode_rows(model, tokens_B, cache, routes_BSLK, col_B, bias_B11W)
        got = make_decode_step(decode_rows, model, cache2, routes2, cuda_graph=False)(tokens_B, col_B, bias_B11W)
    assert torch.equal(got, want) and torch.equal(routes2, routes_BSLK) and torch.equal(cache2.k, cache.k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", CACHES)
def test_cuda_graph_replays_give_the_eager_decode_steps_numbers(kind):
    """Three steps, the window growing: each replay equals eager decode_rows over the full S columns (the graph's
    shape) bit for bit, and writes eager's cache and routes."""
    cfg = load_config(None, MODEL).model
    torch.manual_seed(0)
    model = Transformer(cfg).to("cuda", torch.bfloat16)  # bf16: torch._grouped_mm takes its offsets on the device
    B = 3
    _, cache, routes_BSLK, _, _ = decode_inputs(cfg, B, S, seed=2, dtype=torch.bfloat16, device="cuda", kind=kind)
    cache_eager, routes_eager = copies(cache, routes_BSLK)
    graphed = make_decode_step(decode_rows, model, cache, routes_BSLK, cuda_graph=True)
    assert isinstance(graphed, GraphedDecode)
    with torch.no_grad():
        for step, W in enumerate((3, 4, 6)):
            tokens_B, _, _, col_B, bias_B11W = decode_inputs(cfg, B, W, seed=20 + step, device="cuda")
            got = graphed(tokens_B, col_B, bias_B11W).clone()  # the graph's output buffer is overwritten next replay
            full_B11S = torch.full((B, 1, 1, S), float("-inf"), device="cuda")
            full_B11S[..., :W] = bias_B11W
            want = decode_rows(model, tokens_B, cache_eager, routes_eager, col_B, full_B11S)
            assert torch.equal(got, want), (step, (got - want).abs().max())
            assert torch.equal(routes_BSLK, routes_eager)
            assert torch.equal(cache.k, cache_eager.k) and torch.equal(cache.v, cache_eager.v)
    assert graphed.captures == 1  # one shape, one capture, however W moves


def test_the_cuda_graph_is_refused_under_torchrun_where_capture_would_take_fsdp2s_streams_and_the_cuda_rng(
        monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"engine\.cuda_graph=True under torchrun \(WORLD_SIZE=8\)"):
        load_config(None, MODEL + ["device=cuda", "dtype=bfloat16", "engine.slots=2", "engine.cuda_graph=true",
                                   "dry_run=True"])
