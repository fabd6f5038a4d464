import dataclasses

import pytest
import torch

from model import Transformer, token_logprobs
from rollout import NativeEngine, sample

EOS, PAD = 1, 0


def engine_and_model(cfg):
    model = Transformer(cfg)
    engine = NativeEngine(cfg, eos_id=EOS, pad_id=PAD)
    engine.update_weights(model.named_parameters(), version=3)
    return engine, model


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20]]  # ragged: exercises left padding


def test_trainer_forward_with_replayed_routes_matches_engine_logprobs_and_routes(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    rollouts = engine.generate(PROMPTS, n=2, max_new_tokens=12, seed=0)
    assert len(rollouts) == 6 and [r.group_id for r in rollouts] == [0, 0, 1, 1, 2, 2]
    for r in rollouts:
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        P, C = len(r.prompt_ids), len(r.completion_ids)
        assert r.routes.shape == (P + C - 1, tiny_cfg.num_moe_layers, tiny_cfg.top_k)
        assert r.weight_version == 3
        logits, used = model(seq[None, :-1], routed_experts=r.routes[None], return_routes=True)
        logp = token_logprobs(logits, seq[None, 1:])[0, P - 1:]
        torch.testing.assert_close(logp, r.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(used[0].to(torch.int32), r.routes)  # the trainer used exactly the recorded experts


def test_engine_routes_equal_the_models_own_uncached_routes(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, n=1, max_new_tokens=10, seed=1):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        _, own = model(seq[None, :-1], return_routes=True)
        assert torch.equal(own[0].to(torch.int32), r.routes)


def test_same_seed_gives_the_same_rollouts(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    a = engine.generate(PROMPTS, n=3, max_new_tokens=10, seed=7)
    b = engine.generate(PROMPTS, n=3, max_new_tokens=10, seed=7)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_temperature_zero_is_greedy_and_deterministic(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    a = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0, seed=1)
    b = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0, seed=2)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    r = a[0]
    seq = torch.tensor(r.prompt_ids + r.completion_ids)
    logits, _ = model(seq[None, :-1])
    assert logits[0, len(r.prompt_ids) - 1:].argmax(-1).tolist() == r.completion_ids


def test_rollouts_stop_at_eos_or_token_limit(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, n=4, max_new_tokens=6, seed=3):
        if r.finish_reason == "stop":
            assert r.completion_ids[-1] == EOS and EOS not in r.completion_ids[:-1]
        else:
            assert r.finish_reason == "length" and len(r.completion_ids) == 6 and EOS not in r.completion_ids


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    ids = {int(sample(logits, temperature=1.0, top_p=0.7, generator=gen)[0]) for _ in range(200)}
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
        engine.generate([[3] * 60], max_new_tokens=10)


# ----------------------------------------------------------------------------- cache, seeds, batches

def test_cached_decode_equals_an_uncached_full_forward(tiny_cfg):
    engine, model = engine_and_model(tiny_cfg)
    for r in engine.generate(PROMPTS, n=2, max_new_tokens=10, seed=4):
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        logits, own = model(seq[None, :-1], return_routes=True)  # no cache, no replay
        logp = token_logprobs(logits, seq[None, 1:])[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(logp, r.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(own[0].to(torch.int32), r.routes)


def test_a_rollout_does_not_depend_on_its_batch_mates(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    together = engine.generate(PROMPTS, n=2, max_new_tokens=10, seed=5, group_ids=[10, 11, 12])
    apart = engine.generate([PROMPTS[2], PROMPTS[0]], n=2, max_new_tokens=10, seed=5, group_ids=[12, 10])
    by_key = {(r.group_id, i % 2): r for i, r in enumerate(together)}
    for i, r in enumerate(apart):
        same = by_key[(r.group_id, i % 2)]
        assert r.completion_ids == same.completion_ids
        torch.testing.assert_close(r.logprobs, same.logprobs, rtol=0, atol=1e-5)


def test_samples_of_one_prompt_differ_and_different_seeds_differ(tiny_cfg):
    engine, _ = engine_and_model(tiny_cfg)
    a = engine.generate([PROMPTS[1]], n=4, max_new_tokens=12, seed=0)
    assert len({tuple(r.completion_ids) for r in a}) > 1
    b = engine.generate([PROMPTS[1]], n=4, max_new_tokens=12, seed=1)
    assert [r.completion_ids for r in a] != [r.completion_ids for r in b]


def test_row_uniforms_are_uniform_and_keyed_by_seed_group_and_sample():
    from rollout import row_keys, row_uniforms
    keys = row_keys(0, list(range(2000)), [0] * 2000)
    u = torch.stack([row_uniforms(keys, t) for t in range(20)])
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - 12 ** -0.5) < 0.01
    assert torch.equal(row_keys(3, [7], [1]), row_keys(3, [7], [1]))
    assert len({int(row_keys(s, [g], [j])) for s in (0, 1) for g in (0, 1) for j in (0, 1)}) == 8


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    gen = torch.Generator().manual_seed(0)
    assert {int(sample(logits, temperature=1.0, top_k=2, generator=gen)[0]) for _ in range(200)} == {1, 2}


def test_sampled_logprob_is_under_the_untruncated_tempered_softmax():
    logits = torch.randn(3, 10)
    ids, logp = sample(logits, temperature=0.7, top_k=3, top_p=0.9, u_B=torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    torch.testing.assert_close(logp, (logits / 0.7).log_softmax(-1).gather(-1, ids[:, None])[:, 0])


# ----------------------------------------------------------------------------- weight sync

def test_weight_buckets_respect_the_byte_limit_and_keep_order():
    from rollout import weight_buckets
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # fp32: 4 bytes each
    buckets = list(weight_buckets(named, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]


def test_update_weights_syncs_the_sigmoid_routers_expert_bias(tiny_cfg):
    from rollout import policy_tensors
    cfg = dataclasses.replace(tiny_cfg, router="sigmoid", hf_model_type="glm4_moe")
    model = Transformer(cfg)
    for layer in model.layers:
        layer.mlp.expert_bias.copy_(torch.randn(cfg.num_experts))
    engine = NativeEngine(cfg, eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match="missing"):  # parameters alone leave the bias out
        engine.update_weights(model.named_parameters(), version=1)
    engine.update_weights(policy_tensors(model), version=1)
    assert torch.equal(engine.model.layers[1].mlp.expert_bias, model.layers[1].mlp.expert_bias)
    r = engine.generate([PROMPTS[0]], max_new_tokens=6, seed=0)[0]
    seq = torch.tensor(r.prompt_ids + r.completion_ids)
    _, own = model(seq[None, :-1], return_routes=True)
    assert torch.equal(own[0].to(torch.int32), r.routes)


class _Sharded:
    """Stands in for a DTensor: only full_tensor() gives the values."""

    def __init__(self, t):
        self.t = t

    def full_tensor(self):
        return self.t


def test_update_weights_gathers_sharded_tensors(tiny_cfg):
    model = Transformer(tiny_cfg)
    engine = NativeEngine(tiny_cfg, eos_id=EOS, pad_id=PAD)
    engine.update_weights([(n, _Sharded(p.detach())) for n, p in model.named_parameters()], version=2)
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)
