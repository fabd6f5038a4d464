"""The native engine on the sharded policy (several gloo processes): no replica, and the rollouts one
process's replica engine samples, token for token, with the same logprobs and routes."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed
from config import load_config
from plan import engine_bytes
from rollout import NativeEngine, weight_bytes
from sampler import SamplingParams
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
        engine = NativeEngine(cfg.model, eos_id=EOS, pad_id=0, policy=policy)
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


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# each case spawns its ranks afresh (30-50 s on 2 cores): one in the default run, the others `slow`
@pytest.mark.parametrize("world,ep", [pytest.param(2, 1, marks=pytest.mark.slow), (2, 2),
                                      pytest.param(4, 1, marks=pytest.mark.slow),
                                      pytest.param(4, 2, marks=pytest.mark.slow)],
                         ids=["2ranks-ep1", "2ranks-ep2", "4ranks-ep1", "4ranks-ep2"])
def test_sharded_engine_samples_the_one_process_rollouts_and_holds_no_replica(tmp_path, world, ep):
    cfg = load_config(None, MODEL + [f"ep={ep}"])
    torch.manual_seed(cfg.seed)
    model = distributed.build_model(cfg)  # the weights every rank's shards come from (build_model's parity)
    replica = NativeEngine(cfg.model, eos_id=EOS, pad_id=0)
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
