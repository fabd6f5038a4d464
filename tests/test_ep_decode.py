"""Fixed-capacity expert-parallel dispatch (ep_decode.capacity_dispatch): the same numbers as torchtitan's
dispatcher, bitwise in fp32, and no host sync in a one-token (decode-step) forward, on 2 and 4 gloo ranks.

Host syncs are counted device-agnostically, on CPU: the ops that make the host wait for a CUDA device
(a tensor read as a Python number or list, an output whose size depends on the data) are recorded by a
dispatch mode while one forward runs; `Tensor.tolist` is counted at the Python level (on a CPU tensor
it reads memory without dispatching). torch._grouped_mm on CPU reads its offsets inside its kernel,
seen by no one: on CUDA in bf16 it takes them on the device (ops.grouped_mm), fp32 on CUDA falls back
to one matmul per expert, which syncs. Capturing a decode step in a CUDA graph needs a GPU: not here.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import distributed
from config import load_config
from engines.ep_decode import capacity_dispatch, capacity_experts
from rollout import NativeEngine
from runs import free_port
from sampler import SamplingParams, Vocab

# num_experts=8, top_k=3: at ep=4 each rank holds 2 experts, fewer than K (the capacity's min(K, e))
MODEL = ["model.vocab_size=64", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=8", "model.num_experts=8", "model.top_k=3", "model.moe_inter_dim=16",
         "model.num_shared_experts=1", "model.max_seq_len=64", "model.init_std=0.3"]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.5)
# ops after which the host waits for the device's result (on CUDA): a scalar read, a data-sized output
SYNC_OPS = ("_local_scalar_dense", "nonzero", "bincount", "_unique2", "unique_dim", "unique_consecutive",
            "masked_select", "equal", "is_nonzero")


class SyncCounter(TorchDispatchMode):
    """Records the host syncs (SYNC_OPS, repeat_interleave without output_size, Tensor.tolist) and the
    functional collectives issued while active."""

    def __init__(self):
        super().__init__()
        self.syncs, self.collectives = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                and isinstance(args[0], torch.Tensor) and len(args) == 1):
            self.syncs.append(name)
        if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.collectives.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.syncs.append("tolist")
            return counter._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def tokens_of(rank: int, B: int, T: int) -> torch.Tensor:
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(100 + rank))


def shapes_of(rank: int) -> list[tuple[int, int]]:
    """(B, T) of each forward of a rank: decode-shaped, prefill-shaped, and one for skewed routes."""
    return [(3 + 2 * rank, 1), (2, 4 + rank), (5, 2)]


def worker(rank, world, port, ep):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = load_config(None, MODEL + [f"ep={ep}"])
        torch.manual_seed(cfg.seed)
        model = distributed.build_model(cfg, distributed.build_meshes(world, ep))
        layers, e = cfg.model.num_moe_layers, cfg.model.num_experts // ep

        # 1. the same logits and routes, bitwise: each rank its own token count; the third forward's routes
        # (replayed) all go to rank 0's experts and the next rank's, filling their capacity buffers
        most = max(B * T for r in range(world) for B, T in shapes_of(r))  # the same bound on every rank
        skew = torch.tensor([0, 1, e])[: cfg.model.top_k]  # experts 0, 1 (rank 0) and e (rank 1)
        with torch.no_grad(), distributed.gathered(model):
            for i, (B, T) in enumerate(shapes_of(rank)):
                tokens = tokens_of(rank, B, T)
                replay = skew.expand(B, T, layers, cfg.model.top_k) if i == 2 else None
                want, want_routes = model(tokens, routed_experts=replay, return_routes=True)
                with capacity_dispatch(model, max_tokens=most):
                    got, got_routes = model(tokens, routed_experts=replay, return_routes=True)
                assert torch.equal(got_routes, want_routes)
                assert torch.equal(got, want), (rank, B, T, (got - want).abs().max())

            # 2. a decode-step forward (one token per row): no host sync, as many all-to-alls
            tokens = tokens_of(rank, 4 + rank, 1)
            with SyncCounter() as titan:
                model(tokens)
            with capacity_dispatch(model, max_tokens=8), SyncCounter() as fixed:
                model(tokens)
        assert fixed.syncs == [], fixed.syncs
        # torchtitan's, per layer: model.py's bincount and the dispatcher's two split-size tolists (the counter sees them)
        assert titan.syncs.count("tolist") == 2 * layers and titan.syncs.count("bincount") == layers, titan.syncs
        # counts, rows out, rows back: three all-to-alls per layer, as torchtitan's
        assert fixed.collectives == titan.collectives == ["all_to_all_single"] * 3 * layers, fixed.collectives

        # 3. one graph: a .item() / .tolist() or a data-dependent shape in the dispatch would break it
        moe, x_ND = model.layers[0].mlp, torch.randn(4 + rank, cfg.model.dim)
        with torch.no_grad():
            ids_NK, weights_NK = moe.route(x_ND, None)
            args = (moe.experts, x_ND, ids_NK, weights_NK)  # fp32 grouped GEMMs: ops.grouped_mm's opaque op
            kwargs = dict(exchange=moe.exchange, ep=ep, max_tokens=8)
            traced = torch.compile(capacity_experts, fullgraph=True, backend="eager")(*args, **kwargs)
            assert torch.equal(traced, capacity_experts(*args, **kwargs))

        # 4. the sharded engine samples the same rollouts, token for token, with every forward on fixed shapes
        engine = NativeEngine(cfg.model, Vocab(2, 0), policy=model)
        prompts = [[3 + rank, 4, 5], [6, 7]][: 1 + rank % 2]  # even ranks one prompt, odd ranks two
        with engine.phase():
            with SyncCounter() as titan_gen:
                want = engine.generate(prompts, PARAMS, n=2, seed=7)
            # the most tokens of one forward: a prefill of 2 prompts x 3 columns; a decode step of 4 rows
            with capacity_dispatch(model, max_tokens=6), SyncCounter() as fixed_gen:
                got = engine.generate(prompts, PARAMS, n=2, seed=7)
        for a, b in zip(got, want, strict=True):
            assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
            assert torch.equal(a.routes, b.routes)
        # the engine's own syncs remain (its stop checks, the results' copy); the MoE layers' bincounts are gone
        assert "bincount" in titan_gen.syncs and "bincount" not in fixed_gen.syncs

        # 5. the continuous-batching decode step (batching.decode_rows, over a paged cache) traces as one graph with
        # the eager step's numbers: the all-to-alls (functional collectives) and the experts' DTensor shards inside
        # it, FSDP2's forward hooks, which torch keeps out of every graph, set aside (tests/test_graph_decode.py)
        if ep == 2:
            from test_graph_decode import assert_same_step, decode_inputs, forward_hooks_set_aside
            with torch.no_grad(), distributed.gathered(model), capacity_dispatch(model, max_tokens=4):
                inputs = decode_inputs(cfg.model, B=3 + rank, W=4 + 2 * rank, seed=10 + rank, kind="paged")
                assert_same_step(model, *inputs, traced_in=forward_hooks_set_aside(model))
    finally:
        dist.destroy_process_group()



# each case spawns its ranks afresh (15-30 s on 2 cores): ep=2 in the default run, ep=4 `slow`
@pytest.mark.parametrize("world,ep", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow)], ids=["ep2", "ep4"])
def test_capacity_dispatch_equals_torchtitan_dispatch_and_syncs_nothing(world, ep):
    mp.start_processes(worker, args=(world, free_port(), ep), nprocs=world, join=True, start_method="spawn")


def test_one_process_decode_forward_syncs_nothing():
    """ep=1: no dispatcher, run_experts sorts the pairs on the device; capacity_dispatch passes through."""
    cfg = load_config(None, MODEL)
    model = distributed.build_model(cfg)
    tokens = tokens_of(0, 5, 1)
    with torch.no_grad():
        want, _ = model(tokens)
        with capacity_dispatch(model, max_tokens=5), SyncCounter() as counter:
            got, _ = model(tokens)
    assert counter.syncs == [] and counter.collectives == []
    assert torch.equal(got, want)


def test_capacity_dispatch_refuses_a_bound_below_one():
    cfg = load_config(None, MODEL)
    with pytest.raises(ValueError, match="max_tokens=0"):
        with capacity_dispatch(distributed.build_model(cfg), max_tokens=0):
            pass
