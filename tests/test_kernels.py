import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import GatherRows, causal_attention


def _qkv(T, H=4, G=2, d=8, B=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    return [torch.randn(B, h, T, d, generator=g, dtype=dtype).requires_grad_() for h in (H, G, G)]


def test_cpu_kernels_build_and_load():
    assert kernels._cpu_lib() is not None  # else attention and experts silently take the torch paths


@pytest.mark.parametrize("T, H, G, d, B", [
    (512, 4, 2, 8, 2),  # the block frontier at the bench's length
    (1300, 4, 2, 16, 1),  # three key chunks (online softmax) and a short last query block
    (77, 6, 1, 8, 2),  # multi-query (one kv head), T not a multiple of the block
    (40, 3, 3, 4, 3),  # no GQA, odd head dim
    (1, 2, 1, 8, 1),  # one token; fewer tasks than threads
])
def test_cpu_causal_attention_equals_sdpa_with_gradients(T, H, G, d, B):
    q, k, v = _qkv(T, H, G, d, B)
    y = kernels._cpu_causal(q, k, v)  # the kernel itself, also below CPU_ATTENTION_MIN_TOKENS
    grads = torch.autograd.grad(y.square().sum(), (q, k, v))
    y_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), (q, k, v))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_cpu_causal_attention_takes_strided_inputs_as_the_model_makes_them():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 300, 4 + 2 * 2, 16, generator=g, requires_grad=True)  # (B, T, H+2G, d), fused projection
    q, k, v = (t.transpose(1, 2) for t in qkv.split([4, 2, 2], dim=2))  # views, last dim contiguous
    y = kernels._cpu_causal(q, k, v)
    (grad,) = torch.autograd.grad(y.square().sum(), qkv)
    y_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (grad_ref,) = torch.autograd.grad(y_ref.square().sum(), qkv)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-5)
    assert y.transpose(1, 2).is_contiguous()  # the model's reshape back to (B, T, H*d) needs no copy


def test_cpu_causal_attention_in_bf16_stays_close_to_fp32():
    q, k, v = _qkv(512, dtype=torch.bfloat16)
    y = causal_attention(q, k, v)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16
    y_ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)


def test_cpu_causal_attention_under_torch_compile_matches_eager():
    q, k, v = _qkv(512)
    compiled = torch.compile(lambda q, k, v: causal_attention(q * 2, k, v) + 1)
    torch.testing.assert_close(compiled(q, k, v), causal_attention(q * 2, k, v) + 1)


def test_cpu_kernel_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("EVERYPROMPT_CACHE", str(tmp_path))
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    first = kernels._build(str(src))
    assert kernels._build(str(src)) == first  # built once
    src.write_text("int f(void) { return 2; }\n")
    assert kernels._build(str(src)) != first  # a changed source is rebuilt
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".c", ".so", ".so"]  # no temporaries left


@pytest.mark.parametrize("reps", [1, 3])
def test_gather_rows_backward_equals_autograd_scatter_add(reps):
    g = torch.Generator().manual_seed(reps)
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    order = torch.randperm(10 * reps, generator=g)  # a permutation of the 10*reps copies
    index = order // reps  # each row taken reps times
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(10 * reps))
    out = GatherRows.apply(x, index, inverse, reps)
    torch.testing.assert_close(out, x[index])
    weight = torch.randn(10 * reps, 6, generator=g)
    (grad,) = torch.autograd.grad((out * weight).sum(), x)
    (grad_ref,) = torch.autograd.grad((x[index] * weight).sum(), x)
    torch.testing.assert_close(grad, grad_ref)


def test_short_sequences_take_sdpa_bitwise():
    q, k, v = _qkv(kernels.CPU_ATTENTION_MIN_TOKENS - 1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v), ref)


@pytest.mark.parametrize("counts", [
    [300, 0, 7, 600, 1],  # an empty expert, several row blocks in one, single rows
    [0, 0, 0],  # no rows at all
])
def test_cpu_swiglu_experts_equal_the_grouped_gemms_with_gradients(counts):
    g = torch.Generator().manual_seed(len(counts))
    E, D, I = len(counts), 12, 20
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), D, generator=g, requires_grad=True)
    w13 = (0.3 * torch.randn(E, D, 2 * I, generator=g)).requires_grad_()
    w2 = (0.3 * torch.randn(E, I, D, generator=g)).requires_grad_()
    y = kernels._cpu_swiglu_experts(x, w13, w2, counts)
    y_ref = kernels._torch_swiglu_experts(x, w13, w2, counts)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    weight = torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad((y * weight).sum(), (x, w13, w2))
    grads_ref = torch.autograd.grad((y_ref * weight).sum(), (x, w13, w2))
    for grad, grad_ref in zip(grads, grads_ref):  # weight gradients sum 600 rows in another order
        torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the forward alone keeps no x W13
        torch.testing.assert_close(kernels._cpu_swiglu_experts(x, w13, w2, counts), y_ref)


def test_cpu_kernels_repeat_bitwise():
    # dynamic task order across threads must not change a value (resumed runs stay bitwise equal)
    q, k, v = _qkv(520, H=8, G=2, d=16, B=3)
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([500, 3, 0, 250])
    x = torch.randn(753, 16, generator=g, requires_grad=True)
    w13 = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    w2 = torch.randn(4, 12, 16, generator=g, requires_grad=True)

    inverse = torch.randperm(753, generator=g)
    weights = torch.rand(251, 3, generator=g, requires_grad=True)

    def run():
        y = kernels._cpu_causal(q, k, v)
        z = kernels._cpu_swiglu_experts(x, w13, w2, counts)
        c = kernels._cpu_combine(z, inverse, None, weights)
        loss = y.square().sum() + c.square().sum()
        return [y, z, c, *torch.autograd.grad(loss, (q, k, v, x, w13, w2, weights))]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_without_the_c_kernels_the_torch_paths_run(monkeypatch):
    monkeypatch.setattr(kernels, "_cpu_lib", lambda: None)  # as on a machine without a C compiler
    q, k, v = _qkv(512)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v), ref)
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(9, 4, generator=g), torch.randn(2, 4, 6, generator=g), torch.randn(2, 3, 4, generator=g)
    counts = torch.tensor([5, 4])
    assert torch.equal(kernels.swiglu_experts(x, w13, w2, counts), kernels._torch_swiglu_experts(x, w13, w2, counts))
    order = torch.randperm(9, generator=g)
    inverse, weights = torch.empty_like(order).scatter_(0, order, torch.arange(9)), torch.rand(3, 3, generator=g)
    assert torch.equal(kernels.combine(x, inverse, order, weights), kernels._torch_combine(x, inverse, order, weights))


def test_cpu_combine_equals_the_gather_and_weighted_sum_with_gradients():
    g = torch.Generator().manual_seed(0)
    N, K, D = 600, 3, 10  # more tokens than one task takes
    out = torch.randn(N * K, D, generator=g, requires_grad=True)
    order = torch.randperm(N * K, generator=g)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(N * K))
    weights = torch.rand(N, K, generator=g, requires_grad=True)
    y = kernels._cpu_combine(out, inverse, order, weights)
    y_ref = kernels._torch_combine(out, inverse, order, weights)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    grad_y = torch.randn(N, D, generator=g)
    grads = torch.autograd.grad(y, (out, weights), grad_y)
    grads_ref = torch.autograd.grad(y_ref, (out, weights), grad_y)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
