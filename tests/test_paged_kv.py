"""The paged KV cache of continuous batching (paged_kv.PagedKVCache, engine.page_size / engine.kv_tokens): a static
cache's reads, pages shared by a prompt's rows and returned when rows stop, memory that follows live tokens, and
preemption when the pool runs short that leaves the rollouts as they were."""

import dataclasses

import pytest
import torch

import train
from config import EngineConfig
from engines.batching import ContinuousBatch
from model import KVCache, Transformer
from paged_kv import PagedKVCache, least_pages
from rollout import NativeEngine
from sampler import SamplingParams, Vocab, row_keys

STOPS, PAD = [1, 2, 3], 0
MIXED = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20], [5, 6, 7]]  # ragged, one prompt twice


def bounded(batch):
    """batch, its decode steps capped at what a call that progresses can take (engines.batching's choice 6: a row
    stops at least every C - 1 steps): a livelock fails the test instead of spinning."""
    bound, step = len(batch.length) * (batch.params.max_new_tokens - 1), batch.step

    def checked_step():
        assert batch.stats["decode_steps"] < bound, f"no end within {bound} decode steps: {batch.stats}"
        step()
    batch.step = checked_step
    return batch


def same_rollouts(want, got):
    for x, y in zip(want, got, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.routes, y.routes)
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)


def engines(cfg, **paging):
    model = Transformer(cfg)
    static = NativeEngine(cfg, Vocab(STOPS, PAD))
    paged = NativeEngine(cfg, Vocab(STOPS, PAD), options=EngineConfig(**paging))
    for engine in (static, paged):
        engine.update_weights(model.named_parameters(), version=1)
    return static, paged


def test_paged_reads_equal_a_static_caches_on_every_attended_column(tiny_cfg):
    """Rows written column by column at their own columns read back, gathered from their pages, as a static cache's
    columns [0, W) wherever a row has written (the rest is masked in attention)."""
    B, S, P = 3, 21, 4
    static = KVCache(tiny_cfg, B, S, dtype=torch.float32, device="cpu")
    paged = PagedKVCache(tiny_cfg, B, num_pages=B * 6, page_size=P, max_len=S, dtype=torch.float32, device="cpu")
    start = [0, 5, 11]  # each row's first column
    for s in range(B):  # pages up to each row's first column (what its prompt would hold)
        paged.attach(s, [], 0)
        while len(paged.tables[s]) * P <= start[s]:
            assert paged.grow(s)
    for t in range(10):
        col_B = torch.tensor([c + t for c in start])
        for s, c in enumerate(col_B.tolist()):
            if c // P >= len(paged.tables[s]):
                assert paged.grow(s)
        k, v = torch.randn(B, 2, 1, 8), torch.randn(B, 2, 1, 8)  # (B, J, 1, d)
        W = int(col_B.max()) + 1
        for layer in range(tiny_cfg.n_layers):
            ks, vs = static.update_rows(layer, col_B, k, v, width=W)
            kp, vp = paged.update_rows(layer, col_B, k, v, width=W)
            assert kp.shape == ks.shape == (B, 2, W, 8)
            for s, c in enumerate(col_B.tolist()):  # the columns row s has written so far
                cols = slice(start[s], c + 1)
                assert torch.equal(kp[s, :, cols], ks[s, :, cols]) and torch.equal(vp[s, :, cols], vs[s, :, cols])


def test_a_prompts_full_pages_are_shared_its_last_page_copied_and_every_page_comes_back(tiny_cfg):
    paged = PagedKVCache(tiny_cfg, 3, num_pages=12, page_size=4, max_len=20, dtype=torch.float32, device="cpu")
    k, v = torch.randn(tiny_cfg.n_layers, 2, 10, 8), torch.randn(tiny_cfg.n_layers, 2, 10, 8)  # (L, J, T, d)
    prompt = paged.write_prompt(k, v)  # 10 columns: pages of 4, 4 and 2
    assert len(prompt) == 3 and paged.in_use == 3
    for s in range(3):
        paged.attach(s, prompt, 10)
    # two full pages shared by the three rows and the prompt, each row's own copy of the last
    assert paged.in_use == 3 + 3 and [paged.refs[p] for p in prompt] == [4, 4, 1]
    assert all(t[:2] == prompt[:2] and t[2] not in prompt for t in paged.tables)
    for s in range(3):
        own = paged.tables[s][2]
        assert torch.equal(paged.k[:, own, :, :2], k[:, :, 8:]) and torch.equal(paged.v[:, own, :, :2], v[:, :, 8:])
    paged.release(prompt)  # the prompt's last row is in
    assert paged.in_use == 5
    for s in range(3):
        paged.detach(s)
        assert torch.equal(paged.page_table[s], torch.zeros_like(paged.page_table[s]))
    assert paged.in_use == 0 and sorted(paged.free) == list(range(1, 13)) and paged.peak == 6


def test_a_pool_short_of_pages_preempts_and_gives_the_static_tokens_and_routes(tiny_cfg):
    """kv_tokens at the least the calls need: rows are preempted (generated again from their first token when pages
    free up) and the rollouts are the static engine's, tokens and routes exactly, logprobs to rounding."""
    params = SamplingParams(max_new_tokens=30)
    least = least_pages(6, 30, 4) * 4
    static, paged = engines(tiny_cfg, slots=4, page_size=4, kv_tokens=least)
    a = static.generate(MIXED, params, n=3, seed=4, group_ids=[7, 8, 9, 10])
    b = paged.generate(MIXED, params, n=3, seed=4, group_ids=[7, 8, 9, 10])
    assert paged.batch_stats["preemptions"] > 0 and paged.batch_stats["peak_pages"] <= least // 4
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.routes, y.routes) and x.group_id == y.group_id
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)


def test_pages_in_use_follow_the_live_tokens_and_all_come_back(tiny_cfg):
    """After each step the pages in use are those of the live rows' columns (a page part-filled at most, per row)
    beside the pages of the prompts held for queued rows; at the end none is in use."""
    _, engine = engines(tiny_cfg, slots=3, page_size=4)
    params = SamplingParams(max_new_tokens=40)
    keys = row_keys(5, [g for g in range(4) for _ in range(3)], [j for _ in range(4) for j in range(3)], "cpu")
    batch = ContinuousBatch(engine.parts(), MIXED, 3, params, keys)
    step, seen = batch.step, []

    def checked_step():
        step()
        live = [s for s, r in enumerate(batch.slot_row) if r != -1]
        own = {p for s in live for p in batch.cache.tables[s]}  # shared pages once
        held = {p for pre in batch.prefilled.values() for p in pre.pages}
        assert batch.cache.in_use == len(own | held)
        assert len(own) <= sum(-(-batch.slot_col[s] // 4) for s in live)  # columns fed so far, in pages
        seen.append(batch.cache.in_use)
    batch.step = checked_step
    rollouts = batch.run(list(range(4)), engine.weight_version)
    assert len(rollouts) == 12 and seen and batch.cache.in_use == 0
    assert max(seen) < batch.stats["pages"]  # default pool: every slot at full length, never all used


def test_kv_tokens_below_one_row_at_full_length_is_refused_by_the_engine_and_the_config(tiny_cfg):
    _, engine = engines(tiny_cfg, slots=2, page_size=4, kv_tokens=8)
    with pytest.raises(ValueError, match=r"kv_tokens=8: prompts of up to 6 tokens with max_new_tokens=30 need at "
                                         r"least 44 \(one row at full length"):
        engine.generate(MIXED, SamplingParams(max_new_tokens=30), n=1, seed=0)
    with pytest.raises(ValueError, match="engine.kv_tokens=64: .* need at least"):
        train.parse_args(["configs/tiny.py", "engine.slots=4", "engine.kv_tokens=64"])
    # a recipe's pages with static calls or SGLang: not read, said (switching engines is one setting)
    with pytest.warns(UserWarning, match="engine.kv_tokens=4096: the pages of continuous batching, not read with "
                                         "engine.slots=0"):
        train.parse_args(["configs/tiny.py", "engine.kv_tokens=4096"])
    with pytest.warns(UserWarning, match="engine.slots=96 with name='sglang': each generate round .* are not read"):
        EngineConfig(name="sglang", slots=96)
    with pytest.raises(ValueError, match=r"engine.page_size=1000: a page holds at most model.max_seq_len=256"):
        train.parse_args(["configs/tiny.py", "engine.slots=4", "engine.page_size=1000"])
    with pytest.raises(ValueError, match="page_size=0"):
        EngineConfig(slots=2, page_size=0)


def test_an_admission_round_prefills_at_most_prefill_tokens_and_the_rollouts_stay(tiny_cfg):
    """engine.prefill_tokens: a round's new prompts, left-padded, hold at most that many tokens (one prompt at
    least); the rows it leaves are admitted by the next rounds and sample the same tokens."""
    params, prompts = SamplingParams(max_new_tokens=12), [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20], [30, 31]]
    _, wide = engines(tiny_cfg, slots=8)
    narrow = NativeEngine(tiny_cfg, Vocab(STOPS, PAD), options=EngineConfig(slots=8, prefill_tokens=6))
    narrow.update_weights(wide.model.named_parameters(), version=1)  # the same weights
    rounds = []
    prefill = narrow.prefill_prompts
    narrow.prefill_prompts = lambda ps: rounds.append(len(ps) * max(map(len, ps))) or prefill(ps)
    a = wide.generate(prompts, params, n=2, seed=3)
    b = narrow.generate(prompts, params, n=2, seed=3)
    assert wide.batch_stats["rounds"] == 1 and narrow.batch_stats["rounds"] == len(rounds) > 1
    assert rounds == [3, 6, 4]  # [5, 6, 7] (with [8..13] it would be 12 padded), [8..13], then [20] and [30, 31]
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and torch.equal(x.routes, y.routes)
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_random_pools_pages_and_slots_give_the_static_tokens_and_return_every_page(tiny_cfg, seed):
    """Random prompts (repeated ones too), samples, slots, page sizes and pools from the least up: every call samples
    the static engine's tokens and routes, preempting or not, and ends with every page free and no reference left."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(4, 64, (draw(1, 9),), generator=g).tolist() for _ in range(draw(1, 4))]
    prompts += prompts[:draw(0, 1)]
    n, slots, page, C = draw(1, 3), draw(2, 6), draw(1, 8), draw(8, 30)
    least = least_pages(max(map(len, prompts)), C, page) * page
    kv = least + draw(0, 2) * page if draw(0, 3) else 0  # a quarter of the draws: the default pool
    static, paged = engines(tiny_cfg, slots=slots, page_size=page, kv_tokens=kv)
    keys = row_keys(seed, [i for i in range(len(prompts)) for _ in range(n)], [j for _ in prompts for j in range(n)],
                    "cpu")
    params = SamplingParams(max_new_tokens=C)
    batch = ContinuousBatch(paged.parts(), prompts, n, params, keys)
    got = batch.run(list(range(len(prompts))), paged.weight_version)
    want = static.generate(prompts, params, n=n, seed=seed)
    for x, y in zip(want, got, strict=True):
        assert x.completion_ids == y.completion_ids and x.finish_reason == y.finish_reason
        assert torch.equal(x.routes, y.routes)
        torch.testing.assert_close(y.logprobs, x.logprobs, rtol=0, atol=1e-5)
    cache = batch.cache
    assert cache.in_use == 0 and not any(cache.refs) and sorted(cache.free) == list(range(1, cache.num_pages + 1))
    assert cache.peak <= cache.num_pages and not batch.prefilled


def test_the_least_pool_of_issue_33_finishes_within_the_bound_with_the_static_tokens(tiny_cfg):
    """engine.slots=8, kv_tokens=304 (the least for prompts of 128 tokens, max_new_tokens=48, pages of 16), 4 prompts
    x 4: rows of different prompts cannot share the pool, and a younger row that took an older one's pages had
    two rows preempt each other forever. The oldest row never gives up a page now, so the call ends."""
    cfg = dataclasses.replace(tiny_cfg, max_seq_len=128 + 48)
    g = torch.Generator().manual_seed(33)
    prompts = [torch.randint(4, 64, (128,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_new_tokens=48)
    assert least_pages(128, 48, 16) * 16 == 304
    static, paged = engines(cfg, slots=8, page_size=16, kv_tokens=304)
    keys = row_keys(0, [i for i in range(4) for _ in range(4)], [j for _ in range(4) for j in range(4)], "cpu")
    batch = bounded(ContinuousBatch(paged.parts(), prompts, 4, params, keys))
    got = batch.run(list(range(4)), paged.weight_version)
    same_rollouts(static.generate(prompts, params, n=4, seed=0), got)
    assert batch.stats["preemptions"] > 0


@pytest.mark.parametrize("seed", range(16))
def test_random_pools_down_to_the_least_finish_within_the_bound_with_the_static_tokens(tiny_cfg, seed):
    """Prompts long beside the pool (rows of different prompts fight for it), up to 16 slots, pages of 1 to 16 and
    pools of exactly the least (three draws in four) or a page more: every call ends within X * (C - 1) decode
    steps and samples the static engine's tokens and routes."""
    cfg = dataclasses.replace(tiny_cfg, max_seq_len=32 + 32)
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(4, 64, (draw(1, 32),), generator=g).tolist() for _ in range(draw(1, 4))]
    prompts += prompts[:draw(0, 1)]
    n, slots, page, C = draw(1, 4), draw(2, 16), draw(1, 16), draw(1, 32)
    kv = (least_pages(max(map(len, prompts)), C, page) + (draw(0, 3) == 3)) * page
    static, paged = engines(cfg, slots=slots, page_size=page, kv_tokens=kv)
    groups = [i for i in range(len(prompts)) for _ in range(n)]
    keys = row_keys(seed, groups, [j for _ in prompts for j in range(n)], "cpu")
    params = SamplingParams(max_new_tokens=C)
    batch = bounded(ContinuousBatch(paged.parts(), prompts, n, params, keys))
    got = batch.run(list(range(len(prompts))), paged.weight_version)
    same_rollouts(static.generate(prompts, params, n=n, seed=seed), got)
    assert batch.cache.in_use == 0 and not any(batch.cache.refs)


@pytest.mark.parametrize("kv_tokens", [8, 4], ids=["a-row-cannot-grow", "a-row-cannot-be-admitted"])
def test_a_pool_below_the_least_stops_with_the_settings_and_counts_never_spins(tiny_cfg, monkeypatch, kv_tokens):
    """A pool made too small by hand (the check that refuses it bypassed): two pages of 4 columns, which a row
    outgrows at its fifth token, or one, which cannot admit a prompt of 3 tokens (its page and the row's copy of
    it). The progress guard raises within max_new_tokens decode steps of the last row to stop, naming the
    settings and the counts."""
    monkeypatch.setattr("engines.batching.too_few_pages", lambda *_: "")
    _, paged = engines(tiny_cfg, slots=2, page_size=4, kv_tokens=kv_tokens)
    params = SamplingParams(max_new_tokens=30)
    keys = row_keys(0, [0, 0, 1, 1], [0, 1, 0, 1], "cpu")
    batch = ContinuousBatch(paged.parts(), [[5, 6, 7], [8, 9, 10, 11, 12, 13]], 2, params, keys)
    why = "no row stopped in 30 decode steps" if kv_tokens == 8 else "the next row does not fit an empty pool"
    settings = r"engine.slots=2, engine.kv_tokens=%d, engine.page_size=4 \(%d pages\)" % (kv_tokens, kv_tokens // 4)
    counts = r"\(\d+ decode steps, \d+ preemptions, \d of 4 rows done\)"
    with pytest.raises(RuntimeError, match=f"no progress, {why}.*: {settings} .* {counts}; a pool of kv_tokens >= 44"):
        batch.run([0, 1], paged.weight_version)
    assert batch.stats["decode_steps"] <= 4 * 30
