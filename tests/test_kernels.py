import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import GatherRows, causal_attention


def _qkv(T, H=4, G=2, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    return [torch.randn(2, h, T, d, generator=g, dtype=dtype).requires_grad_() for h in (H, G, G)]


@pytest.mark.parametrize("T, levels", [(512, 1), (1024, 2), (768, 1), (510, 0), (257, 0)])
def test_cpu_causal_attention_equals_sdpa_with_gradients(T, levels):
    splits = 0
    while T % (2 << splits) == 0 and T >> (splits + 1) >= kernels.CPU_ATTENTION_BLOCK:
        splits += 1
    assert splits == levels  # the cases cover no split, one, and two levels
    q, k, v = _qkv(T)
    y = causal_attention(q, k, v)
    grads = torch.autograd.grad(y.square().sum(), (q, k, v))
    y_ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), (q, k, v))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_cpu_causal_attention_in_bf16_stays_close_to_fp32():
    q, k, v = _qkv(512, dtype=torch.bfloat16)
    y = causal_attention(q, k, v)
    assert y.dtype == torch.bfloat16
    y_ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(y.float(), y_ref, rtol=2e-2, atol=2e-2)


def test_cpu_causal_attention_under_torch_compile_matches_eager():
    q, k, v = _qkv(512)
    compiled = torch.compile(lambda q, k, v: causal_attention(q * 2, k, v) + 1)
    torch.testing.assert_close(compiled(q, k, v), causal_attention(q * 2, k, v) + 1)


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
