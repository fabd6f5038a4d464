import pytest
import torch
import torch.nn.functional as F

import math

from model import KVCache, MoE, ModelConfig, Transformer, rope_frequencies
from ops import GatherRows, fused_attention, grouped_mm
from engines.sglang_server import check_routes


@pytest.mark.parametrize("num_shared_experts", [0, 1])
def test_replaying_own_routes_gives_identical_logits(tiny_cfg, num_shared_experts):
    tiny_cfg.num_shared_experts = num_shared_experts
    model = Transformer(tiny_cfg)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (3, 11))
    logits, routes = model(tokens, return_routes=True)
    assert routes.shape == (3, 11, tiny_cfg.num_moe_layers, tiny_cfg.top_k)
    replayed, routes2 = model(tokens, routed_experts=routes, return_routes=True)
    assert torch.equal(routes, routes2)
    torch.testing.assert_close(replayed, logits, rtol=0, atol=0)
    assert (model.layers[0].mlp.shared is not None) == bool(num_shared_experts)


def test_replayed_route_is_used_exactly_with_live_gate_weights(tiny_cfg):
    torch.manual_seed(0)  # unit-normal weights, summed in another order than the reference's: fp32 rounding
    moe = MoE(tiny_cfg)
    ex = moe.experts
    torch.nn.init.normal_(ex.w13), torch.nn.init.normal_(ex.w2)
    I = tiny_cfg.moe_inter_dim
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(1, 5, tiny_cfg.dim)
    # a route the router would not choose: its two lowest-scoring experts
    scores = x[0] @ moe.gate.weight.T
    replay = scores.topk(tiny_cfg.top_k, largest=False).indices[None]  # (1, 5, K)
    y, ids = moe(x, replay)
    assert torch.equal(ids, replay)
    for t in range(5):
        g = scores[t, replay[0, t]].softmax(-1)  # top-k renormalised softmax over the replayed set
        want = sum(g[k] * (F.silu(x[0, t] @ ex.w13[e, :, :I]) * (x[0, t] @ ex.w13[e, :, I:])) @ ex.w2[e]
                   for k, e in enumerate(replay[0, t].tolist()))
        torch.testing.assert_close(y[0, t], want, rtol=1e-4, atol=1e-4)


def test_router_gets_gradient_under_replay(tiny_cfg):
    model = Transformer(tiny_cfg)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 7))
    replay = torch.randint(0, tiny_cfg.num_experts, (2, 7, tiny_cfg.num_moe_layers, 1)).expand(-1, -1, -1, tiny_cfg.top_k)
    replay = replay + torch.arange(tiny_cfg.top_k)  # distinct ids per token
    replay = replay % tiny_cfg.num_experts
    logits, _ = model(tokens, routed_experts=replay)
    logits.logsumexp(-1).mean().backward()
    for layer in model.layers:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


def test_padding_rows_of_minus_one_route_like_the_router(tiny_cfg):
    model = Transformer(tiny_cfg)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 6))
    logits, routes = model(tokens, return_routes=True)
    replay = routes.clone()
    replay[:, 3:] = -1
    logits2, routes2 = model(tokens, routed_experts=replay, return_routes=True)
    assert torch.equal(routes2, routes)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=0)


@pytest.mark.parametrize("bad, msg", [((2, 6, 2, 3), "shape"), ((2, 6, 1, 2), "shape")])
def test_replay_with_wrong_shape_is_a_value_error(tiny_cfg, bad, msg):
    model = Transformer(tiny_cfg)
    with pytest.raises(ValueError, match=msg):
        model(torch.zeros(2, 6, dtype=torch.long), routed_experts=torch.zeros(bad, dtype=torch.long))


# The ids' values are checked where they enter from outside (sglang_server.check_routes, called by
# sglang_server.decode_routed_experts), not in every replayed forward: it syncs with the host.
@pytest.mark.parametrize("value", [-2, 8])
def test_replay_with_out_of_range_expert_id_is_a_value_error(tiny_cfg, value):
    replay = torch.zeros(1, 4, tiny_cfg.num_moe_layers, tiny_cfg.top_k, dtype=torch.long)
    replay[..., 1] = 1  # distinct ids in every row: only the out-of-range one is wrong
    replay[0, 2, 1, 0] = value
    with pytest.raises(ValueError, match="expert"):
        check_routes(replay, tiny_cfg.num_experts)


def test_replay_rows_mixing_padding_or_repeating_an_expert_are_value_errors(tiny_cfg):
    model = Transformer(tiny_cfg)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    _, routes = model(tokens, return_routes=True)
    check_routes(routes, tiny_cfg.num_experts)  # the router's own routes pass
    mixed = routes.clone()
    mixed[0, 1, 0, 0] = -1
    with pytest.raises(ValueError, match="mixing -1"):
        check_routes(mixed, tiny_cfg.num_experts)
    repeated = routes.clone()
    repeated[0, 2, 1, 1] = repeated[0, 2, 1, 0]
    with pytest.raises(ValueError, match="repeats an expert"):
        check_routes(repeated, tiny_cfg.num_experts)


def test_grouped_mm_matches_per_expert_loop_with_empty_experts():
    x = torch.randn(10, 16)
    w = torch.randn(4, 16, 8)
    offs = torch.tensor([3, 3, 10, 10], dtype=torch.int32)  # experts 1 and 3 get no rows
    want = torch.cat([x[:3] @ w[0], x[3:10] @ w[2]])
    torch.testing.assert_close(grouped_mm(x, w, offs), want)


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


def test_model_config_rejects_bad_values():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        ModelConfig(rope_type="dynamic")
    with pytest.raises(ValueError, match="rope_original_max_seq_len"):
        ModelConfig(rope_type="yarn", rope_factor=4.0)  # YaRN's ramp needs the pre-training length


def test_default_rope_is_the_plain_frequency_table_unscaled(tiny_cfg):
    r = tiny_cfg.rotary_dim
    inv_freq, scale = rope_frequencies(tiny_cfg, "cpu")
    assert torch.equal(inv_freq, 1.0 / (tiny_cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r)))
    assert scale == 1.0


def test_yarn_keeps_the_fast_dims_divides_the_slow_ones_by_s_and_scales_cos_sin(tiny_cfg):
    base, _ = rope_frequencies(tiny_cfg, "cpu")
    s = 4.0
    yarn = ModelConfig(**{**vars(tiny_cfg), "rope_type": "yarn", "rope_factor": s, "rope_original_max_seq_len": 4096})
    inv_freq, scale = rope_frequencies(yarn, "cpu")
    # over 4096 positions theta_0 = 1 turns ~650 times (> beta_fast = 32), theta_3 = 1e-3 ~0.65 times (< beta_slow = 1)
    assert inv_freq[0] == base[0] and torch.allclose(inv_freq[-1], base[-1] / s)
    assert scale == 0.1 * math.log(s) + 1.0  # YaRN's sqrt(1/t) (arXiv 2309.00071 section 3.4)
    linear = ModelConfig(**{**vars(tiny_cfg), "rope_type": "linear", "rope_factor": s})
    assert torch.equal(rope_frequencies(linear, "cpu")[0], base / s)


def test_attention_out_bias_puts_a_bias_on_wo_only_when_asked(tiny_cfg):
    assert Transformer(tiny_cfg).layers[0].attn.wo.bias is None
    tiny_cfg.attention_out_bias = True
    wo = Transformer(tiny_cfg).layers[0].attn.wo
    assert wo.bias is not None and torch.equal(wo.bias, torch.zeros(tiny_cfg.dim))  # biases start at zero


def test_bf16_model_runs_and_replays_its_own_routes(tiny_cfg):
    model = Transformer(tiny_cfg).to(torch.bfloat16)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 8))
    logits, routes = model(tokens, return_routes=True)
    again, _ = model(tokens, routed_experts=routes)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    torch.testing.assert_close(again, logits, rtol=0, atol=0)


@pytest.mark.slow  # torch.compile's first compile, about 8 s on 2 idle cores
def test_compiled_blocks_equal_eager_in_fp32_with_grads(tiny_cfg):
    """torch.compile'd blocks (as parallelize(compile=True) makes them) run the fp32 grouped GEMMs
    eagerly inside the graph and match the eager model, forward and backward."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 9))
    logits, _ = model(tokens)
    logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for block in model.layers:
        block.compile()
    compiled, _ = model(tokens)
    compiled.square().mean().backward()
    torch.testing.assert_close(compiled, logits, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_logprobs_from_targets_equal_the_full_logits_path_with_gradients(tiny_cfg):
    """The trainer's forward (targets given) gives token_logprobs and token_entropy of the full logits, and
    the same gradients, while holding only chunks of logits (here 4 positions of 3 x 7)."""
    from logprobs import chunked_logprobs, token_entropy, token_logprobs
    model = Transformer(tiny_cfg)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (3, 8))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, _ = model(inputs)
    want_lp, want_ent = token_logprobs(logits, targets, 0.7), token_entropy(logits, 0.7)
    want_grad = torch.autograd.grad(want_lp.sum(), model.lm_head.weight)[0]
    h, _ = model.hidden(inputs)
    lp, ent = chunked_logprobs(h, model.lm_head.weight, targets, temperature=0.7, chunk=4)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(lp.sum(), model.lm_head.weight)[0], want_grad, rtol=1e-5, atol=1e-6)
    (lp2, ent2), _ = model(inputs, targets, temperature=0.7)  # the same through forward
    torch.testing.assert_close(lp2, want_lp, rtol=1e-5, atol=1e-5)
    assert not ent2.requires_grad  # the entropy never carries a gradient


def test_top_k_1_with_renormalised_gates_is_refused_because_the_router_would_get_no_gradient():
    with pytest.raises(ValueError, match="no gradient"):
        ModelConfig(num_experts=4, top_k=1)
    ModelConfig(num_experts=4, top_k=1, norm_topk_prob=False)  # the raw score is the weight: it trains


def test_replayed_routes_of_a_float_dtype_are_refused():
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, num_experts=4, top_k=2,
                      moe_inter_dim=8, max_seq_len=8)
    model, tokens = Transformer(cfg), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="must be integers"):
        model(tokens, routed_experts=torch.tensor([[[[0.0, 2.7]]] * 3]))  # (1, 3, 1, 2): 2.7 would replay expert 2
    model(tokens, routed_experts=torch.tensor([[[[0, 2]]] * 3], dtype=torch.uint8))  # any integer dtype replays


def left_padded_causal_mask(pads_B: torch.Tensor, T: int) -> torch.Tensor:
    """[B, 1, T, T] bool, True = attend, as the engine's prefill builds it: causal, left padding never a key,
    a pad query sees itself."""
    col_T = torch.arange(T, device=pads_B.device)
    key_ok_BT = col_T[None] >= pads_B[:, None]
    eye_TT = torch.eye(T, dtype=torch.bool, device=pads_B.device)
    return ((col_T[:, None] >= col_T[None]) & (key_ok_BT[:, None] | eye_TT))[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_attention_on_cpu_is_the_plain_sdpa_call_bitwise(dtype, masked):
    q, k, v = (torch.randn(3, h, 9, 8, dtype=dtype) for h in (4, 2, 2))  # (B, H|J|J, T, d)
    mask = left_padded_causal_mask(torch.tensor([0, 2, 5]), 9) if masked else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    assert torch.equal(fused_attention(q, k, v, mask, call="test"), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masked_gqa_bf16_prefill_of_16_rows_at_2048_tokens_runs_on_a_fused_kernel(tiny_cfg):
    """The engine's prefill (a bool mask, H != J, bf16) runs with the math kernel excluded, and its peak
    memory stays under one layer's [B, H, T, T] bf16 scores, which the math kernel would materialise."""
    B, T, dev = 16, 2048, torch.device("cuda")
    tiny_cfg.max_seq_len, tiny_cfg.n_heads = T, 16  # 8 query heads per kv head; math's scores: 2 GiB a layer
    model = Transformer(tiny_cfg).to(dev, torch.bfloat16)
    pads_B = torch.arange(B, device=dev) * 37  # left padding 0 .. 555
    tokens = torch.randint(1, tiny_cfg.vocab_size, (B, T), device=dev).masked_fill_(
        torch.arange(T, device=dev)[None] < pads_B[:, None], 0)
    cache = KVCache(tiny_cfg, B, T, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        h, _ = model.hidden(tokens, pos_BT=(torch.arange(T, device=dev)[None] - pads_B[:, None]).clamp(min=0),
                            cache=cache, cache_start=0, mask_B1TS=left_padded_causal_mask(pads_B, T))
    assert torch.isfinite(h).all()
    assert torch.cuda.max_memory_allocated() - base < B * tiny_cfg.n_heads * T * T * 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_no_fused_kernel_takes_is_an_error_naming_the_call_and_shapes():
    """head_dim 12 in bf16: flash refuses the mask, memory-efficient and cuDNN a head_dim not a multiple of 8."""
    q, k = (torch.randn(2, h, 64, 12, device="cuda", dtype=torch.bfloat16) for h in (4, 2))  # (B, H|J, T, d)
    mask = left_padded_causal_mask(torch.tensor([0, 3], device="cuda"), 64)
    with pytest.raises(RuntimeError, match=r"engine prefill: no fused SDPA kernel .* q \(2, 4, 64, 12\)"):
        fused_attention(q, k, k, mask, call="engine prefill")
