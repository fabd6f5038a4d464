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
