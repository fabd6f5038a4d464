import base64
import dataclasses

import pytest
import torch

from logprobs import token_logprobs
from model import ModelConfig, Transformer, route_dtype
from config import EngineConfig
from rollout import NativeEngine
from sampler import SamplingParams, Vocab, sample, texts

EOS, PAD = 1, 0


def engine_and_model(cfg):
    model = Transformer(cfg)
    engine = NativeEngine(cfg, Vocab(EOS, PAD))
    engine.update_weights(model.named_parameters(), version=3)
    return engine, model


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20]]  # ragged: exercises left padding


def test_trainer_forward_with_replayed_routes_matches_engine_logprobs_and_routes(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12), n=2, seed=0)
    assert len(rollouts) == 6 and [r.group_id for r in rollouts] == [0, 0, 1, 1, 2, 2]
    for r in rollouts:
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        P, C = len(r.prompt_ids), len(r.completion_ids)
        assert r.routes.shape == (P + C - 1, tiny_cfg.num_moe_layers, tiny_cfg.top_k)
        assert r.weight_version == 3
        logits, used = model(seq[None, :-1], routed_experts=r.routes[None], return_routes=True)
        logp = token_logprobs(logits, seq[None, 1:])[0, P - 1:]
        torch.testing.assert_close(logp, r.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(used[0], r.routes.long())  # the trainer used exactly the recorded experts


def test_engine_routes_equal_the_models_own_uncached_routes(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), n=1, seed=1):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        _, own = model(seq[None, :-1], return_routes=True)
        assert torch.equal(own[0], r.routes.long())


def test_same_seed_gives_the_same_rollouts(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), n=3, seed=7)
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), n=3, seed=7)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_temperature_zero_is_greedy_and_deterministic(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), n=2, seed=1)
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0), n=2, seed=2)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    r = a[0]
    seq = torch.tensor(r.prompt_ids + r.completion_ids)
    logits, _ = model(seq[None, :-1])
    assert logits[0, len(r.prompt_ids) - 1:].argmax(-1).tolist() == r.completion_ids


def test_rollouts_stop_at_eos_or_token_limit(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=4, seed=3):
        if r.finish_reason == "stop":
            assert r.completion_ids[-1] == EOS and EOS not in r.completion_ids[:-1]
        else:
            assert r.finish_reason == "length" and len(r.completion_ids) == 6 and EOS not in r.completion_ids


def test_each_rollout_carries_its_text_as_the_tokenizers_decode_of_its_ids(tiny_cfg):
    """An engine built with a decode gives each rollout its text (what verifiers read), static and continuous alike,
    the stop token left out; one built without leaves it None, which sampler.texts refuses, naming the fix."""
    def decode(ids):
        return " ".join(map(str, ids))
    model = Transformer(tiny_cfg)
    for options in (EngineConfig(), EngineConfig(slots=2)):
        engine = NativeEngine(tiny_cfg, Vocab(EOS, PAD, decode=decode), options=options)
        engine.update_weights(model.named_parameters(), version=0)
        rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2, seed=3)
        assert texts(rollouts) == [decode(r.text_ids) for r in rollouts]
        assert all(EOS not in r.text_ids for r in rollouts)
    bare, _ = engine_and_model(tiny_cfg)
    rollouts = bare.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2, seed=3)
    assert all(r.text is None for r in rollouts)
    with pytest.raises(ValueError, match=r"6 of 6 rollouts have no text: build the engine with decode=tok.decode"):
        texts(rollouts)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    u = torch.rand(200, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = {int(sample(logits, SamplingParams(max_new_tokens=1, top_p=0.7), u[i])[0]) for i in range(200)}
    assert ids == {0, 1}


def test_update_weights_rejects_unknown_and_missing_tensors(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    with pytest.raises(ValueError, match="unknown"):
        engine.update_weights([("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(list(model.named_parameters())[:2], version=1)
    name, p = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(p.shape[0] + 1))], version=1)


def test_prompt_too_long_for_the_context_is_a_value_error(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[3] * 60], SamplingParams(max_new_tokens=10))


# ----------------------------------------------------------------------------- cache, seeds, batches

def test_cached_decode_equals_an_uncached_full_forward(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), n=2, seed=4):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        logits, own = model(seq[None, :-1], return_routes=True)  # no cache, no replay
        logp = token_logprobs(logits, seq[None, 1:])[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(logp, r.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(own[0], r.routes.long())


def test_a_rollout_does_not_depend_on_its_batch_mates(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    together = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10), n=2, seed=5, group_ids=[10, 11, 12])
    apart = engine.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(max_new_tokens=10), n=2, seed=5, group_ids=[12, 10])
    by_key = {(r.group_id, i % 2): r for i, r in enumerate(together)}
    for i, r in enumerate(apart):
        same = by_key[(r.group_id, i % 2)]
        assert r.completion_ids == same.completion_ids
        torch.testing.assert_close(r.logprobs, same.logprobs, rtol=0, atol=1e-5)


def test_samples_of_one_prompt_differ_and_different_seeds_differ(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    a = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12), n=4, seed=0)
    assert len({tuple(r.completion_ids) for r in a}) > 1
    b = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12), n=4, seed=1)
    assert [r.completion_ids for r in a] != [r.completion_ids for r in b]


def test_row_uniforms_are_uniform_and_keyed_by_seed_group_and_sample():
    from sampler import row_keys, row_uniforms
    keys = row_keys(0, list(range(2000)), [0] * 2000)
    u = torch.stack([row_uniforms(keys, t) for t in range(20)])
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - 12 ** -0.5) < 0.01
    assert torch.equal(row_keys(3, [7], [1]), row_keys(3, [7], [1]))
    assert len({int(row_keys(s, [g], [j])) for s in (0, 1) for g in (0, 1) for j in (0, 1)}) == 8


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    u = torch.rand(200, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert {int(sample(logits, SamplingParams(max_new_tokens=1, top_k=2), u[i])[0]) for i in range(200)} == {1, 2}


def test_sampled_logprob_is_under_the_untruncated_tempered_softmax():
    logits = torch.randn(3, 10)
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=3, top_p=0.9)
    ids, logp = sample(logits, params, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    torch.testing.assert_close(logp, (logits / 0.7).log_softmax(-1).gather(-1, ids[:, None])[:, 0])


# ----------------------------------------------------------------------------- weight sync

def test_weight_buckets_respect_the_byte_limit_and_keep_order():
    from weights import weight_buckets
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # fp32: 4 bytes each
    buckets = list(weight_buckets(named, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_update_weights_syncs_the_sigmoid_routers_expert_bias(tiny_cfg):
    from weights import policy_tensors
    cfg = dataclasses.replace(tiny_cfg, router="sigmoid", hf_model_type="glm4_moe")
    model = Transformer(cfg)
    for layer in model.layers:
        layer.mlp.expert_bias.copy_(torch.randn(cfg.num_experts))
    engine = NativeEngine(cfg, Vocab(EOS, PAD))
    with pytest.raises(ValueError, match="missing"):  # parameters alone leave the bias out
        engine.update_weights(model.named_parameters(), version=1)
    engine.update_weights(policy_tensors(model), version=1)
    assert torch.equal(engine.model.layers[1].mlp.expert_bias, model.layers[1].mlp.expert_bias)
    r = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6), seed=0)[0]
    seq = torch.tensor(r.prompt_ids + r.completion_ids)
    _, own = model(seq[None, :-1], return_routes=True)
    assert torch.equal(own[0], r.routes.long())


class _Sharded:
    """Stands in for a DTensor: only full_tensor() gives the values."""

    def __init__(self, t):
        self.t = t

    def full_tensor(self):
        return self.t


def test_update_weights_gathers_sharded_tensors(tiny_cfg):
    model = Transformer(tiny_cfg)
    engine = NativeEngine(tiny_cfg, Vocab(EOS, PAD))
    engine.update_weights([(n, _Sharded(p.detach())) for n, p in model.named_parameters()], version=2)
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)


# ----------------------------------------------------------------------------- FP8

def test_blockwise_fp8_round_trip_is_within_e4m3_precision():
    from weights import FP8, dequantize_fp8_blockwise, quantize_fp8_blockwise
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)  # columns of very different scales
    q, s = quantize_fp8_blockwise(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (2, 3)  # ceil(200/128) x ceil(300/128) blocks
    back = dequantize_fp8_blockwise(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value, or of the block's
    # smallest normal (448 * 2^-6 * 2^-... absolute floor) for tiny values
    err = (back - w).abs()
    bound = w.abs() * 2 ** -4 + s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2 ** -9
    assert bool((err <= bound).all())


def test_fp8_engine_quantises_attention_and_experts_only(tiny_cfg):
    from weights import FP8
    engine = NativeEngine(tiny_cfg, Vocab(EOS, PAD), options=EngineConfig(fp8=True))
    engine.update_weights(Transformer(tiny_cfg).named_parameters(), version=1)
    low = {n for n, t in engine._tensors.items() if t.dtype == FP8}
    assert low == {f"layers.{i}.{w}" for i in range(tiny_cfg.n_layers)
                   for w in ("attn.wqkv.weight", "attn.wo.weight", "mlp.experts.w13", "mlp.experts.w2")}


def test_trainer_side_quantisation_equals_quantisation_on_arrival(tiny_cfg):
    from weights import quantize_fp8
    model = Transformer(tiny_cfg)
    a = NativeEngine(tiny_cfg, Vocab(EOS, PAD), options=EngineConfig(fp8=True))
    b = NativeEngine(tiny_cfg, Vocab(EOS, PAD), options=EngineConfig(fp8=True))
    a.update_weights(model.named_parameters(), version=1)
    b.update_weights(quantize_fp8(model.named_parameters()), version=1)
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x.float(), y.float()), n


def test_fp8_engine_logprobs_stay_near_the_high_precision_ones(tiny_cfg):
    model = Transformer(tiny_cfg).requires_grad_(False)
    engine = NativeEngine(tiny_cfg, Vocab(EOS, PAD), options=EngineConfig(fp8=True))
    engine.update_weights(model.named_parameters(), version=1)
    for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), n=2, seed=0):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        logp = token_logprobs(model(seq[None, :-1], routed_experts=r.routes[None])[0], seq[None, 1:])[0, len(r.prompt_ids) - 1:]
        assert float((logp - r.logprobs).abs().max()) < 0.05  # FP8 noise, not a different model


# ----------------------------------------------------------------------------- SGLang (CPU: request and payloads)

def _sglang_output(ids, logps, routes_TLK, reason="stop"):
    """One result of sglang.Engine.generate in its documented shape (meta_info keys as SGLang returns them)."""
    return {"output_ids": list(ids), "meta_info": {
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(logps, ids)],
        "finish_reason": {"type": reason, "matched": ids[-1]} if reason == "stop" else {"type": reason, "length": len(ids)},
        "routed_experts": base64.b64encode(routes_TLK.to(torch.int32).numpy().tobytes()).decode("ascii")}}


def test_sglang_request_asks_for_logprobs_routes_and_seeded_samples():
    from engines.sglang_server import sglang_request
    req = sglang_request([[1, 2], [3]], SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, top_k=0), n=2, seed=7, eos_id=9, group_ids=[4, 5])
    assert req["input_ids"] == [[1, 2], [1, 2], [3], [3]]
    assert req["return_logprob"] and req["return_routed_experts"] and req["routed_experts_start_len"] == 0
    p = req["sampling_params"]
    assert p[0]["top_k"] == -1 and p[0]["stop_token_ids"] == [9] and p[0]["max_new_tokens"] == 5
    assert len({q["sampling_seed"] for q in p}) == 4
    again = sglang_request([[3]], SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, top_k=0), n=2, seed=7, eos_id=9, group_ids=[5])
    assert [q["sampling_seed"] for q in again["sampling_params"]] == [q["sampling_seed"] for q in p[2:]]


def test_sglang_output_decodes_to_a_rollout_with_moe_layers_only(tiny_cfg):
    from engines.sglang_server import decode_sglang_output
    cfg = dataclasses.replace(tiny_cfg, n_layers=3, first_k_dense_replace=1, dense_inter_dim=16, router="sigmoid",
                              hf_model_type="glm4_moe")
    prompt, ids, logps = [5, 6, 7], [11, 12, EOS], [-0.5, -1.0, -0.25]
    all_layers = torch.arange(5 * 3 * 2).view(5, 3, 2) % cfg.num_experts  # [P + C - 1, num_hidden_layers, K]
    r = decode_sglang_output(_sglang_output(ids, logps, all_layers), prompt, cfg=cfg, group_id=4, weight_version=2)
    assert r.completion_ids == ids and r.finish_reason == "stop" and r.group_id == 4 and r.weight_version == 2
    torch.testing.assert_close(r.logprobs, torch.tensor(logps))
    # dense layer 0 dropped; SGLang's int32 ids kept in the smallest dtype that holds them
    assert r.routes.dtype == route_dtype(cfg.num_experts) and torch.equal(r.routes.long(), all_layers[:, 1:])


def test_routes_travel_in_the_smallest_integer_type_that_holds_every_expert_id():
    assert [route_dtype(e) for e in (2, 128, 256, 257, 32768, 32769)] == [
        torch.uint8, torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


def test_sglang_payload_of_the_wrong_size_is_a_value_error(tiny_cfg):
    from engines.sglang_server import decode_sglang_output
    out = _sglang_output([11, 12], [-0.1, -0.2], torch.zeros(3, tiny_cfg.n_layers, tiny_cfg.top_k))  # one row short
    with pytest.raises(ValueError, match="routed_experts"):
        decode_sglang_output(out, [5, 6, 7], cfg=tiny_cfg, group_id=0, weight_version=0)


class _FakeSGLang:
    """Records the calls SGLangEngine makes; begin/end exist only when sessions=True (0.5.21 vs 0.5.7)."""

    def __init__(self, sessions: bool):
        self.calls = []
        if sessions:
            self.begin_weight_update = lambda: self.calls.append("begin") or (True, "")
            self.end_weight_update = lambda: self.calls.append("end") or (True, "")

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))
        return True, "ok"

    def flush_cache(self):
        self.calls.append("flush")


@pytest.mark.parametrize("sessions", [True, False])
def test_sglang_weight_sync_brackets_buckets_with_sessions_when_present(tiny_cfg, sessions):
    from weights import policy_tensors
    from sglang_engine import InProcessServer, SGLangEngine
    fake = _FakeSGLang(sessions)
    engine = SGLangEngine.from_engine(InProcessServer(fake), tiny_cfg, Vocab(EOS), bucket_bytes=64 << 10)
    engine.update_weights(policy_tensors(Transformer(tiny_cfg)), version=5)
    updates = [c for c in fake.calls if isinstance(c, tuple)]
    names = [n for c in updates for n in c[1]]
    assert len(updates) > 1 and not any(c[2] for c in updates)  # bucketed, one cache flush at the end
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert fake.calls[-1] == "flush" and engine.weight_version == 5
    assert (fake.calls[0] == "begin" and fake.calls[-2] == "end") if sessions else "begin" not in fake.calls


def test_sglang_fp8_sync_sends_e4m3_weights_with_inverse_scales(tiny_cfg):
    from weights import FP8
    from sglang_engine import InProcessServer, SGLangEngine
    sent = {}
    fake = _FakeSGLang(True)
    fake.update_weights_from_tensor = lambda named_tensors, flush_cache=True: sent.update(named_tensors) or (True, "")
    cfg = dataclasses.replace(tiny_cfg, head_dim=64, moe_inter_dim=128)  # whole 128-blocks, as SGLang's FP8 needs
    engine = SGLangEngine.from_engine(InProcessServer(fake), cfg, Vocab(EOS), fp8=True)
    engine.update_weights(Transformer(cfg).named_parameters(), 1)
    assert sent["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    assert sent["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.float32
    # the router and lm_head are never FP8: bf16, the dtype SGLang serves (the fp32 masters are not sent)
    assert sent["model.layers.0.mlp.gate.weight"].dtype == sent["lm_head.weight"].dtype == torch.bfloat16


def test_sglang_engine_without_sglang_or_cuda_says_what_is_missing():
    from sglang_engine import SGLangEngine
    with pytest.raises((ImportError, RuntimeError), match="SGLangEngine needs"):
        SGLangEngine("/nonexistent", ModelConfig(), Vocab(EOS))


@pytest.mark.cuda
@pytest.mark.sglang
def test_sglang_engine_rollouts_match_the_trainer(tiny_cfg, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (SGLang runs on CUDA only)")
    pytest.importorskip("sglang", reason="needs sglang (GPU machines: pip install -r requirements-sglang.txt)")
    from hf import save_hf
    from espo import mismatch_metrics
    from sglang_engine import SGLangEngine
    cfg = dataclasses.replace(tiny_cfg, qk_norm=True, vocab_size=256, max_seq_len=128)
    model = Transformer(cfg)
    save_hf(model, str(tmp_path))
    engine = SGLangEngine(str(tmp_path), cfg, Vocab(EOS), mem_fraction_static=0.3)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), n=2, seed=0)
    infer, trainer = [], []
    for r in rollouts:
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        assert r.routes.shape == (len(seq) - 1, cfg.num_moe_layers, cfg.top_k)
        logits = model(seq[None, :-1], routed_experts=r.routes[None])[0]
        trainer.append(token_logprobs(logits, seq[None, 1:])[0, len(r.prompt_ids) - 1:])
        infer.append(r.logprobs)
    assert mismatch_metrics(infer, trainer)["mismatch/max_abs_logp"] < 0.1


@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_rollouts(tiny_cfg):
    model = Transformer(tiny_cfg)
    eager = NativeEngine(tiny_cfg, Vocab(EOS, PAD))
    compiled = NativeEngine(tiny_cfg, Vocab(EOS, PAD), compile=True)
    for e in (eager, compiled):
        e.update_weights(model.named_parameters(), version=0)
    a = eager.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2, seed=0)
    b = compiled.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2, seed=0)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(x.routes, y.routes)


def test_fp8_checkpoint_holds_e4m3_weights_with_inverse_scales_that_dequantise_to_the_model(tiny_cfg, tmp_path):
    import json

    from safetensors.torch import load_file

    from hf import hf_tensors, save_hf
    from weights import policy_tensors
    from weights import FP8, dequantize_fp8_blockwise
    cfg = dataclasses.replace(tiny_cfg, qk_norm=True)  # a Qwen3-MoE
    model = Transformer(cfg)
    save_hf(model, str(tmp_path), fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["torch_dtype"] == "bfloat16"
    saved = load_file(tmp_path / "model.safetensors")
    for name, want in hf_tensors(policy_tensors(model), cfg):
        if saved[name].dtype == FP8:  # attention and expert matrices
            got = dequantize_fp8_blockwise(saved[name], saved[name + "_scale_inv"])
            assert (got - want).abs().max() <= want.abs().max() / 16  # e4m3 keeps 3 mantissa bits
        else:  # router, norms, embeddings, lm_head stay high precision
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], want.to(torch.bfloat16))
    assert any(t.dtype == FP8 for t in saved.values()) and any(n.endswith(".mlp.gate.weight") for n in saved)
