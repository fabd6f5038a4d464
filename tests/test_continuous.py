"""Continuous batching in NativeEngine (slots=N): the same rollouts as the static engine, in fewer decode row-steps."""

import pytest
import torch

from model import Transformer
from config import EngineConfig
from rollout import NativeEngine
from sampler import SamplingParams, Vocab, row_keys, row_uniforms, row_uniforms_at

STOPS, PAD = [1, 2, 3], 0  # three stop ids of 64: rows stop after a few to a few tens of tokens, lengths vary
EQUAL = [[5, 6, 7], [8, 9, 10], [20, 21, 22]]
MIXED = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20], [5, 6, 7]]  # ragged, and one prompt twice (one prefill)


def engines(cfg, slots):
    model = Transformer(cfg)
    static, continuous = (NativeEngine(cfg, Vocab(STOPS, PAD), options=EngineConfig(slots=s)) for s in (0, slots))
    for engine in (static, continuous):
        engine.update_weights(model.named_parameters(), version=2)
    return static, continuous, model


def test_a_slot_per_row_and_equal_prompts_give_the_static_rollouts_bit_for_bit(tiny_cfg):
    static, continuous, _ = engines(tiny_cfg, slots=100)
    params = SamplingParams(max_new_tokens=20, top_p=0.95)
    a = static.generate(EQUAL, params, n=3, seed=1)
    b = continuous.generate(EQUAL, params, n=3, seed=1)
    assert len({len(r.completion_ids) for r in a}) > 1  # rows stop at different steps
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.logprobs, y.logprobs) and torch.equal(x.routes, y.routes)
        assert (x.group_id, x.weight_version) == (y.group_id, y.weight_version)


def test_fewer_slots_than_rows_and_mixed_prompts_give_the_static_tokens_and_routes(tiny_cfg):
    # logprobs agree to rounding, not bit for bit: a row's attention reduces over a window of another width
    # (the highest live column of its batch-mates) and its matmuls run beside other rows
    static, continuous, _ = engines(tiny_cfg, slots=2)
    params = SamplingParams(max_new_tokens=20)
    a = static.generate(MIXED, params, n=3, seed=4, group_ids=[7, 8, 9, 10])
    b = continuous.generate(MIXED, params, n=3, seed=4, group_ids=[7, 8, 9, 10])
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.routes, y.routes) and x.group_id == y.group_id
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)
    assert continuous.batch_stats["prefills"] == 3  # the repeated prompt was prefilled once


def test_continuous_routes_cover_the_prompt_and_fed_tokens_as_the_trainer_replays_them(tiny_cfg):
    _, continuous, model = engines(tiny_cfg, slots=2)
    for r in continuous.generate(MIXED, SamplingParams(max_new_tokens=12), n=2, seed=3):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        assert r.routes.shape == (P + C - 1, tiny_cfg.num_moe_layers, tiny_cfg.top_k)  # [T + C - 1, L, K]
        seq = torch.tensor(r.prompt_ids + r.completion_ids)
        logits, used = model(seq[None, :-1], routed_experts=r.routes[None], return_routes=True)
        logp = logits[0, P - 1:].log_softmax(-1).gather(-1, seq[P:, None])[:, 0]
        torch.testing.assert_close(logp, r.logprobs, rtol=0, atol=1e-5)
        _, own = model(seq[None, :-1], return_routes=True)  # the model's own routing, nothing replayed
        assert torch.equal(own[0], r.routes.long()) and torch.equal(used[0], r.routes.long())


def test_a_stopped_rows_slot_takes_the_next_row(tiny_cfg):
    _, continuous, _ = engines(tiny_cfg, slots=2)
    rollouts = continuous.generate(MIXED, SamplingParams(max_new_tokens=16), n=3, seed=5)
    stats, lengths = continuous.batch_stats, [len(r.completion_ids) for r in rollouts]
    assert stats["slots"] == 2 and stats["admissions"] == stats["rows"] == 12  # 10 admissions into freed slots
    assert stats["useful_row_steps"] == sum(c - 1 for c in lengths)  # every live row-step fed a kept token
    # two slots in flight: at most a row's first token (from its prefill) per slot is not a decode step
    assert stats["decode_steps"] >= (sum(lengths) - 12) / 2
    assert stats["decode_steps"] < sum(lengths)  # the two slots decode side by side


def test_one_new_token_is_sampled_from_the_prefill_alone(tiny_cfg):
    static, continuous, _ = engines(tiny_cfg, slots=2)
    params = SamplingParams(max_new_tokens=1)
    a, b = static.generate(MIXED, params, n=2, seed=6), continuous.generate(MIXED, params, n=2, seed=6)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert all(r.routes.shape[0] == r.prompt_len for r in b) and continuous.batch_stats["decode_steps"] == 0


def test_slots_are_refused_below_zero(tiny_cfg):
    with pytest.raises(ValueError, match="slots=-1"):
        EngineConfig(slots=-1)


def test_a_per_row_draw_index_gives_each_rows_own_stream_draw():
    keys = row_keys(3, [0, 1, 2, 3], [0, 1, 0, 1])
    steps = [0, 5, 17, 1 << 40]
    expected = torch.cat([row_uniforms(keys[i:i + 1], t) for i, t in enumerate(steps)])
    assert torch.equal(row_uniforms_at(keys, torch.tensor(steps)), expected)
