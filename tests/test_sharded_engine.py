"""The native engine on the sharded policy (several gloo processes): no replica, and the rollouts one
process's replica engine samples, token for token, with the same logprobs and routes; batching
continuously (slots), the static sharded engine's rollouts, the ranks in lockstep."""
import os
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed
import engines.batching
from config import EngineConfig, load_config
from model import MoE
from plan import engine_bytes
from paged_kv import least_pages
from rollout import NativeEngine, weight_bytes
from runs import free_port
from sampler import SamplingParams, Vocab
from weights import policy_tensors

# vocab_size: the byte-level demo tokenizer's 259 ids fit (bpe_merges=0), a relation load_config checks
MODEL = ["model.vocab_size=320", "bpe_merges=0", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=8", "model.num_experts=4", "model.top_k=2", "model.moe_inter_dim=16", "model.max_seq_len=64",
         "model.init_std=0.3", "gen_batch_rows=8", "sampling.max_new_tokens=10", "max_prompt_tokens=7"]
# five prompts of different lengths: with 4 ranks one rank has no prompt of its own and decodes a placeholder
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17], [18, 19]]
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.5)
N, SEED, EOS = 3, 7, 2


def record(rollouts):
    return [(r.group_id, r.completion_ids, r.logprobs, r.routes.long(), r.finish_reason) for r in rollouts]


def worker(rank, world, port, ep, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config(None, MODEL + [f"ep={ep}"])
        meshes = distributed.build_meshes(world, ep)
        torch.manual_seed(cfg.seed)
        policy = distributed.build_model(cfg, meshes)
        engine = NativeEngine(cfg.model, Vocab(EOS, 0), policy=policy)
        mine = list(range(rank, len(PROMPTS), world))  # this rank's prompts (with 4 ranks, rank 3 holds only one)
        with engine.phase():
            got = engine.generate([PROMPTS[i] for i in mine], PARAMS, n=N, seed=SEED, group_ids=mine)
            # a second call in the same phase, on one rank only's prompts: the others join with placeholders
            extra = engine.generate([PROMPTS[0]] if rank == 0 else [], PARAMS, n=1, seed=SEED + 1)
            memory = engine.memory()  # this phase's: its gathered weights and largest KV cache (a collective)
        everyone = distributed.all_gather_list(record(got))
        if rank == 0:
            torch.save({"rollouts": everyone, "extra": record(extra), "memory": memory}, out)
    finally:
        dist.destroy_process_group()



# each case spawns its ranks afresh (30-50 s on 2 cores): one in the default run, the others `slow`
@pytest.mark.parametrize("world,ep", [pytest.param(2, 1, marks=pytest.mark.slow), (2, 2),
                                      pytest.param(4, 1, marks=pytest.mark.slow),
                                      pytest.param(4, 2, marks=pytest.mark.slow)],
                         ids=["2ranks-ep1", "2ranks-ep2", "4ranks-ep1", "4ranks-ep2"])
def test_sharded_engine_samples_the_one_process_rollouts_and_holds_no_replica(tmp_path, world, ep):
    cfg = load_config(None, MODEL + [f"ep={ep}"])
    torch.manual_seed(cfg.seed)
    model = distributed.build_model(cfg)  # the weights every rank's shards come from (build_model's parity)
    replica = NativeEngine(cfg.model, Vocab(EOS, 0))
    replica.update_weights(policy_tensors(model), version=0)
    want = record(replica.generate(PROMPTS, PARAMS, n=N, seed=SEED))
    want_extra = record(replica.generate([PROMPTS[0]], PARAMS, n=1, seed=SEED + 1))

    mp.start_processes(worker, args=(world, free_port(), ep, str(tmp_path / "out.pt")), nprocs=world, join=True,
                       start_method="spawn")
    out = torch.load(tmp_path / "out.pt")
    got = sorted(out["rollouts"], key=lambda r: r[0])  # group-major; a group's samples stay in order
    assert len(got) == len(want)
    for (g, ids, logp, routes, why), (wg, wids, wlogp, wroutes, wwhy) in zip(got + out["extra"], want + want_extra):
        assert (g, ids, why) == (wg, wids, wwhy)
        torch.testing.assert_close(logp, wlogp, rtol=0, atol=1e-5)
        assert torch.equal(routes, wroutes)

    # what the engine held: the gathered dense weights and this rank's experts, no replica; as the plan says
    mem, plan = out["memory"], engine_bytes(cfg, world)
    replica_bytes = sum(weight_bytes(replica.model).values())
    assert (mem["dense"], mem["experts"]) == (plan["dense"], plan["experts"]), (mem, plan)
    assert 0 < mem["kv_cache"] <= plan["kv_cache"]
    if ep > 1:
        assert mem["dense"] + mem["experts"] < replica_bytes


# continuous batching on the sharded policy: two slots, rows of ragged lengths (32 stop ids of 320: about a tenth
# of the rows stop at each token), and uneven shares: rank 0's rows are done long before rank 1's
SLOTS, STOPS = 2, tuple(range(2, 34))
SHARES = [[2], [0, 1, 3, 4]]  # each rank's prompts (indices into PROMPTS, the rollouts' group ids)


def continuous_worker(rank, world, port, kv_tokens):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config(None, MODEL + ["ep=2"])
        torch.manual_seed(cfg.seed)
        policy = distributed.build_model(cfg, distributed.build_meshes(world, 2))
        static = NativeEngine(cfg.model, Vocab(STOPS, 0), policy=policy)
        continuous = NativeEngine(cfg.model, Vocab(STOPS, 0), policy=policy,
                                  options=EngineConfig(slots=SLOTS, page_size=4, kv_tokens=kv_tokens))
        mine = SHARES[rank]
        calls = [([PROMPTS[i] for i in mine], N, mine), ([PROMPTS[1]] if rank else [], 1, [1] if rank else None)]
        with static.phase():
            want = [static.generate(p, PARAMS, n=n, seed=SEED, group_ids=g) for p, n, g in calls]
        moes = [m for m in policy.modules() if isinstance(m, MoE)]
        count = {"forwards": 0, "exchanges": 0}
        for m in moes:  # every MoE forward, and the fixed-size all-to-alls of capacity_dispatch's path
            m.register_forward_hook(lambda *_: count.update(forwards=count["forwards"] + 1))
            m.exchange = partial(lambda f, t: count.update(exchanges=count["exchanges"] + 1) or f(t), m.exchange)
        got, stats = [], []
        with continuous.phase():
            for p, n, g in calls:
                got.append(continuous.generate(p, PARAMS, n=n, seed=SEED, group_ids=g))
                stats.append(dict(continuous.batch_stats))
        for a, b in zip(sum(want, []), sum(got, []), strict=True):
            assert (a.group_id, a.completion_ids, a.finish_reason) == (b.group_id, b.completion_ids, b.finish_reason)
            assert torch.equal(a.routes, b.routes)
            torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
        if rank == 1:  # ragged lengths, so slots were refilled mid-call (and rows preempted in a pool of the least)
            assert len({len(r.completion_ids) for r in got[0]}) > 1
            assert stats[0]["admissions"] == 12 + stats[0]["preemptions"] and (stats[0]["preemptions"] > 0) == bool(kv_tokens)
        # lockstep: both ranks ran as many decode steps and admission rounds (rank 0's idle slots and placeholder
        # prefills), until the last row of either rank stopped
        assert distributed.all_gather_list([(s["decode_steps"], s["rounds"]) for s in stats]) == \
            [(s["decode_steps"], s["rounds"]) for s in stats] * 2
        # every decode step's MoE layers went through the fixed-size all-to-alls (three each), the prefills' not
        steps, rounds = sum(s["decode_steps"] for s in stats), sum(s["rounds"] for s in stats)
        assert count["exchanges"] == 3 * len(moes) * steps and count["forwards"] == len(moes) * (steps + rounds)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kv_tokens", [pytest.param(0, marks=pytest.mark.slow),  # the preempting pool covers more
                                       4 * least_pages(max(map(len, PROMPTS)), PARAMS.max_new_tokens, 4)],
                         ids=["pages-for-every-slot", "least-pages-preempting"])
def test_continuous_sharded_engine_samples_the_static_sharded_rollouts_in_lockstep(kv_tokens):  # about 10 s each
    mp.start_processes(continuous_worker, args=(2, free_port(), kv_tokens), nprocs=2, join=True, start_method="spawn")


def stalled_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank that raised alone would leave the other waiting in its next collective: fail in a minute, not hang
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        cfg = load_config(None, MODEL + ["ep=2"])
        torch.manual_seed(cfg.seed)
        policy = distributed.build_model(cfg, distributed.build_meshes(world, 2))
        engines.batching.too_few_pages = lambda *_: ""  # rank 1's pool is made too small by hand
        options = EngineConfig(slots=SLOTS, page_size=4, kv_tokens=8 if rank else 0)
        engine = NativeEngine(cfg.model, Vocab(STOPS, 0), policy=policy, options=options)
        with engine.phase():
            try:
                engine.generate([PROMPTS[i] for i in SHARES[rank]], PARAMS, n=N, seed=SEED, group_ids=SHARES[rank])
                raised = ""
            except RuntimeError as e:
                raised = str(e)
            # both ranks left the call at the same step, in lockstep still: this collective meets
            everyone = distributed.all_gather_list([(raised, engine.batch_stats.get("decode_steps"))])
        if rank == 0:
            torch.save(everyone, out)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_makes_no_progress_stops_every_rank_together(tmp_path):  # about 10 s
    """Rank 1's pool holds two pages of 4 columns, fewer than a row of 10 tokens needs; rank 0's holds every slot.
    Rank 1's progress guard says STALLED in the move's all-reduce, and both ranks raise at the same step."""
    mp.start_processes(stalled_worker, args=(2, free_port(), str(tmp_path / "out.pt")), nprocs=2, join=True,
                       start_method="spawn")
    (why0, steps0), (why1, steps1) = torch.load(tmp_path / "out.pt")
    assert why0.startswith("continuous batch made no progress, another rank stalled: engine.slots=2, "
                           "engine.kv_tokens=0")
    assert why1.startswith("continuous batch made no progress, no row stopped in 10 decode steps (a row needs at most "
                           "9): engine.slots=2, engine.kv_tokens=8, engine.page_size=4 (2 pages)")
    assert steps0 == steps1
