"""The dry run: parameter counts and a per-GPU memory plan measured from the code that runs.

`python train.py configs/100b.py dry_run=True` prints, for 1, 2, 4 and 8 nodes, what one GPU
holds. The trainer's part is not estimated: `trainer_memory` builds the policy as
distributed.build_model does (the same `parallelize`, mixed precision and activation
checkpointing) on fake tensors (torch's FakeTensorMode: shapes and dtypes, no storage) in a
fake process group of the run's world size, runs two training steps of one micro-batch
(forward with the chunked logprobs, backward, AdamW) and reads the peak from torch's memory
tracker (FSDPMemTracker; MemTracker for a plain one-process model). The rollout engine's part
(`engine_memory`, `engine_bytes`) adds up what NativeEngine allocates: its weights (choice 4)
and, while it generates, the KV cache and routes of gen_batch_rows rows (engine.slots rows when it
batches continuously, choice 7) of max_prompt_tokens + max_new_tokens tokens, the prefill, and the
sampler's [rows, V] buffers.
bench/memory.py and tests/test_plan.py check both against measured peaks of real runs on CPU.
Shapes: B, T, V, D, E, K, L, J, d, S (letters of the README's legend).

Notable choices:
1. Expert parallel is planned by its memory, not run: a rank holds E / ep experts of each
   layer and computes about N * K routed rows of its micro-batch's N tokens (balanced
   routing), so the fake model has E / ep experts per layer, sharded over the efsdp ranks
   as the real ones are; the all-to-all's send and receive buffers (2 x N * K x D) are added.
2. The micro-batch is microbatch_tokens tokens in rows of min(max_seq_len, microbatch_tokens)
   (the packer's widest case), rounded so the routed rows split evenly over the experts
   (ops.grouped_mm's stand-in on fake tensors).
3. Every block after the dense ones is the same, so memory is affine in the number of layers
   once the peak falls at the same point of the step (from two MoE blocks on): the fake steps
   run with two and three MoE blocks and the result is extended to L blocks (tests/test_plan.py
   checks this against the full depth). A 46-layer 100B plan then takes seconds, not minutes.
4. The engine's weights. One process: a replica of the policy in the run's dtype, kept through
   training, so the peak of a run is the larger of a training step's peak plus the replica and
   the trainer's parameters and AdamW state plus a generate call's peak plus the replica. Several
   ranks: no replica; the engine decodes with the policy's own parameters, the dense ones gathered
   (FSDP2 unshard, in the compute dtype, router gates fp32) for the rollout phase and freed after
   it, the routed experts expert-parallel (E / ep per rank, gathered over efsdp ranks in the
   compute dtype; with ep = world the trainer's own fp32 shards). The two phases never overlap, so
   the peak is the larger of a training step's and the rollout phase's (parameters, AdamW, the
   gathered weights and a generate call's peak, with the all-to-all's buffers).
5. Margins beside the larger phase: the CUDA context, NCCL's buffers for each communicator a
   rank uses (the default group and the fsdp mesh's from two ranks on, ep's and efsdp's where
   they split), and a fragmentation reserve of the peak. The constants are allowances, not
   measurements: nothing here has run on a GPU yet.
6. A colocated SGLang server (engine.name='sglang', engine.sglang_urls ''), one per node, tensor
   parallel over its GPUs. SGLang sizes its static pool (weights and KV cache) when it starts so
   that the GPU's used memory reaches mem_fraction_static of its capacity, counting what the
   trainer holds then (its fp32 parameters: the server starts before the first optimizer step),
   and keeps its CUDA graphs and workspace outside the pool (server_args.py, the model runner's
   profile_max_num_token: rest = available - total * (1 - mem_fraction_static)). AdamW's state
   arrives later and stays through the rollout phase, when the server wakes: so the largest
   fraction that fits leaves room for it, the margins and the graphs; its KV pool is what the
   fraction leaves after the trainer's parameters and the served weights (the checkpoint's
   bf16, or FP8, over tensor parallel ranks). A training step runs with the server asleep.
7. Continuous batching (engine.slots > 0): a step's generate round, or an eval pass, is one call per rank
   of all its rows, `slots` of them live (batching.ContinuousBatch), so the decode routes and the sampler hold
   `slots` rows whatever gen_batch_rows and eval_batch_rows say, and the KV cache is a pool of pages
   (paged_kv.PagedKVCache) of engine.kv_tokens columns: the engine's KV memory is what the user sizes by live
   tokens, not rows x max length (0 = `slots` rows at full length, the bound that never preempts). The call holds the
   pool from its start; an admission round prefills the new prompts of at most N rows into a left-padded cache
   of their own, written into pages and dropped; a decode step gathers one layer's window of N rows x S
   columns at a time (paged_kv's choice 2); the call keeps the X rows' tokens, logprobs and routes until it
   returns. X per rank is the largest round's: prompts_per_step (a round of over-sampling draws no more) over
   the ranks, times the round's rows per prompt.
8. A reward model or judge (reward.model=<folder> or judge:<folder>; `scorer_memory`, from its config.json's
   ModelConfig, which the caller reads: reward_model.scorer_model_config) is whole on every GPU (each rank
   scores its own rollouts), or with reward.rm_shard a reward model's 1/world (FSDP: the root and one block
   gathered while it scores), and held through the run: its weights add to every phase, and its scoring peak
   comes after the rollouts are generated, beside the trainer's parameters, AdamW and the engine's weights. A
   reward model: bf16 on CUDA (fp32 elsewhere, as reward_model.HFRewardModel picks) with its score head,
   scoring min(rm_batch_size, group) rows of the prompt + completion + SCORER_EXTRA_TOKENS without grad,
   roughly a prefill's largest tensors. A judge: a NativeEngine replica in the run's dtype, one generate call
   per group (a row per rollout) of judge_max_new_tokens beyond a prompt of the question, answer and
   SCORER_EXTRA_TOKENS (`generate_peak`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from logprobs import LOGITS_CHUNK_TOKENS
from model import ModelConfig, Transformer, route_dtype
from paged_kv import pool_pages, too_few_pages

GB = 1024 ** 3
# what PyTorch can allocate on each (torch.cuda.get_device_properties(0).total_memory, as its out-of-memory
# messages print it: "GPU 0 has a total capacity of 79.11 GiB"): below the GB sold, which are 10^9 bytes
# and include memory the driver keeps. A plan fits where its total, margins included, is at most this.
GPU_MEMORY_GIB = {"H100 80GB": 79.11, "H200 141GB": 139.81}
# Margins (choice 5), allowances until bench/gpu.py's reading on a GPU replaces them: the CUDA context and the
# kernels torch loads (outside the caching allocator), each NCCL communicator's buffers (channels x peers x
# NCCL_BUFFSIZE, 4 MiB by default, and NVLink SHARP's on H100/H200), and the caching allocator's fragmentation
# as a share of the peak (with expandable_segments, which train.main sets on CUDA).
CUDA_CONTEXT_GIB = 1.0
NCCL_COMMUNICATOR_GIB = 0.5
FRAGMENTATION = 0.05
# A colocated SGLang server's memory outside its static pool (choice 6): CUDA graphs captured for its decode batch
# sizes and the forward's workspace (SGLang leaves 1 - mem_fraction_static of the GPU for them), an allowance
SGLANG_OUTSIDE_POOL_GIB = 5.0
NODES = (1, 2, 4, 8)
# HBM bandwidth (NVIDIA's H100 SXM and H200 datasheets): a decode step reads at least the engine's weights once, so
# decode steps x weight bytes / bandwidth is a floor under the rollouts' time (`first_update`)
HBM_BYTES_PER_S = {"H100 80GB": 3.35e12, "H200 141GB": 4.8e12}
# a scorer's input beyond the policy's prompt and completion (choice 8): a reward model's chat template, or
# JUDGE_PROMPT's instructions, the template and the reference answer; an allowance, not a bound
SCORER_EXTRA_TOKENS = 512


def param_counts(cfg: ModelConfig) -> dict:
    """Total, routed-expert and active parameters of the model, counted on the meta device.

    Active = total minus the routed experts a token does not use: (E - K) / E of them.
    Embedding and lm_head count in both.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for b in model.layers if b.is_moe for p in b.mlp.experts.parameters())
    active = total - experts * (cfg.num_experts - cfg.top_k) // cfg.num_experts
    outer = sum(p.numel() for p in model.embed.parameters()) + sum(p.numel() for p in model.lm_head.parameters())
    return {"total": total, "experts": experts, "active": active, "embed_lm_head": outer}


def microbatch_shape(cfg, num_local_experts: int) -> tuple[int, int]:
    """(rows, tokens per row) of a full micro-batch (choice 2)."""
    T = min(cfg.model.max_seq_len, cfg.microbatch_tokens)
    B = max(1, cfg.microbatch_tokens // T)
    while (B * T * cfg.model.top_k) % num_local_experts:  # an even split over the experts: shorten the rows
        T -= 1
    return B, T


def trainer_memory(cfg, world: int, *, activation_checkpoint: bool) -> dict[str, int]:
    """Peak bytes of one rank's training step in a run of `world` ranks, measured on fake tensors.

    Returns the peak `total` and its parts at that moment: params (the rank's shard of fp32
    weights), grads, optimizer (AdamW's moments), gathered (weights all-gathered for compute, and
    FSDP's communication buffers), activations (saved for backward, temporaries, the logits
    chunks) and ep_buffers (choice 1). Sets up, and ends, a fake process group of `world` ranks:
    it must not run inside a real one.
    """
    dense = cfg.model.first_k_dense_replace
    if cfg.model.n_layers <= dense + 4:  # as quick to run as the two short ones
        return _fake_steps(cfg, world, activation_checkpoint, cfg.model.n_layers)
    two, three = (_fake_steps(cfg, world, activation_checkpoint, dense + k) for k in (2, 3))
    extra = cfg.model.n_layers - dense - 2  # blocks beyond the second MoE one (choice 3)
    return {k: two[k] + (three[k] - two[k]) * extra for k in two}


def _fake_steps(cfg, world: int, activation_checkpoint: bool, n_layers: int) -> dict[str, int]:
    """trainer_memory of the model cut to its first n_layers blocks."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import distributed
    ep = cfg.ep if world > 1 else 1
    model_cfg = dataclasses.replace(cfg.model, n_layers=n_layers, num_experts=cfg.model.num_experts // ep,
                                    n_group=1, topk_group=1)  # a rank's experts (choice 1)
    run_cfg = dataclasses.replace(cfg, model=model_cfg, device="cpu", dtype=str(cfg.compute_dtype())[6:])
    B, T = microbatch_shape(run_cfg, model_cfg.num_experts)
    sharded = world > 1 or cfg.compute_dtype() != torch.float32  # as distributed.setup_distributed decides
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with torch.device("meta"):
            model = Transformer(model_cfg)
        if sharded:
            fsdp = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
            efsdp = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "efsdp"))["efsdp"] \
                if ep > 1 else None
            distributed.parallelize(model, distributed.Meshes(fsdp=fsdp, efsdp=efsdp),
                                    **distributed.mixed_precision(run_cfg), activation_checkpoint=activation_checkpoint)
        else:
            distributed.checkpoint_and_compile(model, activation_checkpoint=activation_checkpoint, compile=False)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # ops.grouped_mm's fake stand-in returns a view (nothing writes to it in place); the real op does not
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            model.to_empty(device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            if sharded:
                tracker = FSDPMemTracker(model, opt)
            else:
                tracker = MemTracker()
                tracker.track_external(model, opt)
            with tracker:
                for _ in range(2):  # the second step holds the AdamW state the first one made
                    tokens = torch.zeros(B, T, dtype=torch.long)
                    (logp, _), _ = model(tokens, tokens, temperature=cfg.sampling.temperature)
                    (-logp.mean()).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()  # per-module stats of one step; the peak is kept
        # {category: bytes} at the peak; the categories are enum members of the two trackers
        peak = {getattr(k, "name", k).lower(): v for k, v in tracker.get_tracker_snapshot("peak")[
            torch.device("cpu")].items()}
    finally:
        dist.destroy_process_group()
    parts = {"params": peak.get("param", 0) + peak.get("sharded_param", 0) + peak.get("buffer", 0),
             "grads": peak.get("grad", 0) + peak.get("sharded_grad", 0) + peak.get("unsharded_grad", 0),
             "optimizer": peak.get("opt", 0),
             "gathered": peak.get("unsharded_param", 0) + peak.get("all_gather", 0) + peak.get("reduce_scatter", 0),
             "activations": peak.get("act", 0) + peak.get("temp", 0) + peak.get("inp", 0) + peak.get("oth", 0)}
    dt = torch.tensor([], dtype=cfg.compute_dtype()).element_size()
    parts["ep_buffers"] = 2 * B * T * cfg.model.top_k * cfg.model.dim * dt if ep > 1 else 0
    parts["total"] = peak["total"] + parts["ep_buffers"]
    return parts


def engine_bytes(cfg, world: int) -> dict[str, int]:
    """Bytes one rank's NativeEngine decodes with, from the real parameter shapes (a meta-device model).

    dense: every parameter but the routed experts (embedding, attention, norms, shared experts,
    dense FFNs, lm_head) in the compute dtype, the router gates (`mlp.gate.weight`) in fp32 in
    any dtype, and the buffers (the routers' expert_bias: the replica's in the compute dtype, the
    policy's fp32, which FSDP neither shards nor casts). experts: the routed experts
    (`mlp.experts.*`) a rank holds, E / ep of each MoE layer (all E in one process): in the compute
    dtype, except where expert parallelism alone splits them (ep = world, no efsdp mesh): then they
    sit outside FSDP and the engine decodes the trainer's own fp32 shards (model.GroupedExperts
    casts a layer at a time), 4 bytes each.
    kv_cache: model.KVCache's k and v, [n_layers, gen_batch_rows, J, S, d] each in the compute
    dtype, S = prompt_limit() + max_new_tokens - 1 columns; with engine.slots the pages'
    (`kv_columns`, choice 7). One process (world == 1): the replica's. Raises ValueError if ep does
    not divide world and num_experts.
    """
    m, dt = cfg.model, torch.tensor([], dtype=cfg.compute_dtype()).element_size()
    parts = _engine_weights(cfg, world)
    return {"dense": parts["dense"], "experts": parts["experts"],
            "kv_cache": 2 * m.n_layers * kv_columns(cfg) * m.n_kv_heads * m.head_dim * dt}


def kv_columns(cfg) -> int:
    """Columns of keys and values (each of n_layers x J x d) a rank's engine holds while it generates: gen_batch_rows
    rows x S in a static call; with engine.slots the page pool's (paged_kv.pool_pages, its scratch page with it)."""
    P, C = cfg.prompt_limit(), cfg.sampling.max_new_tokens
    if not cfg.engine.slots:
        return cfg.gen_batch_rows * (P + C - 1)
    page = cfg.engine.page_size
    return (pool_pages(cfg.engine.slots, P, C, page, cfg.engine.kv_tokens) + 1) * page


def _experts_are_trainer_shards(cfg, world: int) -> bool:
    """Whether the engine decodes the trainer's own expert tensors: EP-only experts (ep = world > 1), which
    distributed.parallelize leaves outside FSDP, so nothing gathers or casts them ahead of the rollout phase."""
    return world > 1 and cfg.ep == world


def _engine_weights(cfg, world: int) -> dict[str, int]:
    """engine_bytes' dense and experts, and the bytes of the largest FSDP unit the rollout phase gathers
    (distributed.parallelize's units: the root, each block, each gate, each layer's experts when efsdp > 1),
    whose all-gather buffer is briefly alive beside its gathered copy."""
    m, dt = cfg.model, torch.tensor([], dtype=cfg.compute_dtype()).element_size()
    ep = cfg.ep if world > 1 else 1
    if world % ep or m.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the world size {world} and num_experts={m.num_experts}")
    expert_dt = 4 if _experts_are_trainer_shards(cfg, world) else dt
    with torch.device("meta"):
        model = Transformer(m)
    out, units = {"dense": 0, "experts": 0}, {}
    for name, p in model.named_parameters():  # a tied lm_head once, as the embedding
        block = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"  # its block's unit or the root
        if name.endswith("mlp.gate.weight"):  # the router: fp32 in any dtype, an FSDP unit of its own
            out["dense"] += p.numel() * 4
            units[name] = p.numel() * 4
        elif ".mlp.experts." in name:
            n = p.numel() // ep * expert_dt  # this rank's E / ep experts
            out["experts"] += n
            if ep == 1:  # no expert mesh: the experts are part of their block's unit
                units[block] = units.get(block, 0) + n
            elif world > ep:  # a unit of their own over the efsdp ranks (with ep = world nothing gathers them)
                units[name.rsplit(".", 1)[0]] = units.get(name.rsplit(".", 1)[0], 0) + n
        else:
            out["dense"] += p.numel() * dt
            units[block] = units.get(block, 0) + p.numel() * dt
    out["dense"] += sum(b.numel() for b in model.buffers()) * (4 if world > 1 else dt)  # never gathered: no unit
    return {**out, "largest_unit": max(units.values())}


def engine_memory(cfg, world: int = 1) -> dict[str, int]:
    """Bytes one rank's NativeEngine adds while it generates: its weights and the peak of a generate call
    of gen_batch_rows rows whose prompts are max_prompt_tokens long (rollout.py `_prefill`, `_decode`), or
    with engine.slots the largest continuously batched call's (`continuous_peak`, choice 7).

    One process: a replica of the policy in the run's dtype (choice 4). world > 1: no replica; the
    dense weights gathered for the rollout phase and the rank's experts (`engine_bytes`), whose
    prefill and decode add expert parallelism's all-to-all buffers. Returns dense, experts (as
    engine_bytes), weights (what the engine holds beyond the trainer's state: dense + experts, or
    dense alone where the experts are the trainer's own shards), kv_cache (part of generate),
    generate (the call's peak, or the gathering's if larger) and total (weights + generate).
    """
    own = _engine_weights(cfg, world)
    weights = own["dense"] + (0 if _experts_are_trainer_shards(cfg, world) else own["experts"])
    if cfg.engine.slots:  # one call per round and rank, `slots` rows live (choice 7)
        step, evals = -(-cfg.prompts_per_step // world), -(-cfg.eval_size // world)  # prompts per rank
        rest = max(cfg.group_size, cfg.filter.enlarged_group_size) - cfg.filter.probe_size  # 0 probes: a whole group
        n_prompts = [(step, rest), (step, cfg.filter.probe_size or rest), (evals, cfg.eval_samples), (evals, 1)]
        generate = max(continuous_peak(cfg, world, p * n, n) for p, n in n_prompts)
    else:
        # the run's generate calls, (rows, samples per prompt): a step's groups and its probes, and the evals'
        # sampled and greedy passes; a call prefills rows / samples distinct prompts, a greedy eval one per row
        n_rows = [(cfg.gen_batch_rows, cfg.group_size), (cfg.gen_batch_rows, cfg.filter.probe_size or cfg.group_size),
                  (cfg.eval_batch_rows, cfg.eval_samples), (cfg.eval_batch_rows, 1)]
        generate = max(generate_peak(cfg, world, rows, max(1, rows // n)) for rows, n in n_rows)
    if world > 1:  # gathering unit by unit: one unit's all-gather buffer beside its copy, before the call
        generate = max(generate, own["largest_unit"])
    return {"dense": own["dense"], "experts": own["experts"], "weights": weights,
            "kv_cache": engine_bytes(cfg, world)["kv_cache"], "generate": generate, "total": weights + generate}


def generate_peak(cfg, world: int, B: int, U: int, *, pages: int = 0) -> int:
    """The peak bytes of one generate call of B rows and U distinct prompts, max_prompt_tokens each (beyond
    the engine's weights): its prefill, the copy into the decode cache, or decoding, whichever is largest.
    pages: a continuous batch's (choice 7): the decode cache is a pool of that many columns, alive with the
    routes before the prefill, and a decode step gathers one layer's window of B rows x S columns."""
    m, dt = cfg.model, torch.tensor([], dtype=cfg.compute_dtype()).element_size()
    own, ep, aliased = _engine_weights(cfg, world), cfg.ep if world > 1 else 1, _experts_are_trainer_shards(cfg, world)
    P, C = cfg.prompt_limit(), cfg.sampling.max_new_tokens
    S = P + C - 1  # cache columns: the prompt and every sampled token but the last
    LK, kv_token = m.num_moe_layers * m.top_k, 2 * m.n_kv_heads * m.head_dim * dt  # k and v of a token, one layer
    prefill_cache = m.n_layers * U * P * kv_token
    kv = m.n_layers * (pages or B * S) * kv_token  # engine_bytes' kv_cache, at B rows or a pool of `pages` columns
    window = B * S * kv_token if pages else 0  # paged_kv.update_rows: k and v of one layer, gathered
    routes = B * S * LK * torch.tensor([], dtype=route_dtype(m.num_experts)).element_size()  # model.route_dtype
    # under EP a forward sends each token's K routed rows to their experts' ranks and receives as many back
    # (balanced routing): send and receive buffers of N * K rows of D, as the trainer's (choice 1)
    a2a = 2 * m.top_k * m.dim * dt if ep > 1 else 0  # per token
    # EP-only experts are the trainer's fp32 shards, cast to the compute dtype one layer at a time
    cast = own["experts"] // max(1, m.num_moe_layers) * dt // 4 if aliased and dt != 4 else 0
    # the prefill: its U-row cache and one forward over U x P tokens, whose largest per-layer tensors are the
    # routed rows (x, the expert GEMMs' [2I] and [I] outputs, the result: K copies of every token), or a dense
    # block's SwiGLU ([2I] out of w13, silu(gate) and the product, [I] each), and the mask
    ffn = max(m.top_k * (2 * m.dim + 3 * m.moe_inter_dim), 4 * m.dense_inter_dim if m.first_k_dense_replace else 0)
    acts = U * P * (4 * m.dim + ffn) * dt + U * P * P
    prefill = prefill_cache + acts + U * P * LK * 8 + U * P * a2a + cast
    # the copy of each row's prompt into the decode cache: both caches, one layer's gathered rows, the routes,
    # and still alive from the prefill its mask and hidden states
    copy = prefill_cache + kv + (0 if pages else B * P * kv_token // 2) + U * P * LK * 8 + routes + U * P * (P + m.dim * dt)
    # decoding: the cache and routes, the sampler's [B, V] buffers (logits, tempered logits, log-softmax and
    # probabilities fp32, their cumulative sum fp64), the row mask, and the sampled ids and logprobs
    decode = kv + window + routes + B * m.vocab_size * (4 * 4 + 8) + B * S * 4 + B * C * (8 + 4) + B * a2a + cast
    if pages:
        prefill += kv + routes
    return max(prefill, copy, decode + routes)  # the end: the rollouts' own copies of their routes


def continuous_peak(cfg, world: int, X: int, n: int) -> int:
    """The peak bytes of one continuously batched generate call (engine.slots, choice 7) of X rows, n per prompt,
    max_prompt_tokens each (beyond the engine's weights): an admission round's prefill, the copy into pages or
    decoding with min(slots, X) rows live (`generate_peak` of those rows, the round's distinct prompts and the
    call's page pool, allocated first), beside the call's X rows of tokens, logprobs and routes. An upper bound."""
    m, dt = cfg.model, torch.tensor([], dtype=cfg.compute_dtype()).element_size()
    P, C = cfg.prompt_limit(), cfg.sampling.max_new_tokens
    B = min(cfg.engine.slots, X)
    # B consecutive rows of a prompt-major queue span at most U prompts, and a round prefills prefill_tokens at most
    U = min(-(-X // n), -(-(B + n - 1) // n), max(1, cfg.engine.prefill_tokens // P))
    page = cfg.engine.page_size
    pages = (pool_pages(B, P, C, page, cfg.engine.kv_tokens) + 1) * page  # columns, the scratch page with them
    route = torch.tensor([], dtype=route_dtype(m.num_experts)).element_size()
    # (X + 1, C) ids int64 and logprobs fp32, and each finished row's routes [P + C - 1, L, K]
    outputs = (X + 1) * C * (8 + 4) + X * (P + C - 1) * m.num_moe_layers * m.top_k * route
    ep = cfg.ep if world > 1 else 1
    # expert parallel: a decode step's fixed-size buffers (ep_decode.capacity_experts), ep blocks of slots * min(K, E/ep)
    # rows whatever the routes: sent, received, sorted, returned rows of D and the experts' [2I] and [I] outputs
    rows = ep * cfg.engine.slots * min(m.top_k, m.num_experts // ep)
    capacity = rows * (4 * m.dim + 3 * m.moe_inter_dim) * dt if ep > 1 else 0
    return generate_peak(cfg, world, B, U, pages=pages) + outputs + capacity


def scorer_memory(cfg, scorer: ModelConfig | None, world: int = 1) -> dict[str, int]:
    """Bytes one GPU of `world` holds for the run's reward model or judge whose ModelConfig is `scorer` (None: none,
    or a stand-in; zeros): weights (held through the run) and peak (of scoring one group, beyond the weights),
    choice 8; with reward.rm_shard on several GPUs 1/world of the weights, and the root's and one block's gathered
    in the peak."""
    if scorer is None:
        return {"weights": 0, "peak": 0}
    G = max(cfg.group_size, cfg.filter.enlarged_group_size)  # a group's rollouts: what one scoring call takes
    tokens = cfg.prompt_limit() + cfg.sampling.max_new_tokens + SCORER_EXTRA_TOKENS  # what a scorer reads of a rollout
    if cfg.reward.judges:  # one greedy generate call per group, a row per rollout
        new = cfg.reward.judge_max_new_tokens
        judge = dataclasses.replace(cfg, model=scorer, max_prompt_tokens=min(tokens, scorer.max_seq_len - new), ep=1,
                                    sampling=dataclasses.replace(cfg.sampling, max_new_tokens=new),
                                    engine=dataclasses.replace(cfg.engine, slots=0))
        own = _engine_weights(judge, 1)
        return {"weights": own["dense"] + own["experts"], "peak": generate_peak(judge, 1, G, G)}
    dt = 2 if torch.device(cfg.device).type == "cuda" else 4  # reward_model.HFRewardModel's default dtype
    with torch.device("meta"):
        model = Transformer(scorer)
    weights = (sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()) + scorer.dim) * dt
    m, N = scorer, min(G, cfg.reward.rm_batch_size) * tokens  # a batch's tokens
    # its forward's largest tensors, as generate_peak's prefill, the final hidden states and every layer's routes
    acts = N * (4 * m.dim + m.top_k * (2 * m.dim + 3 * m.moe_inter_dim)) * dt + N * m.dim * dt
    peak = acts + N * m.num_moe_layers * m.top_k * 8
    if cfg.reward.rm_shard and world > 1:  # FSDP units: each block, and the root (its embedding; no lm_head)
        blocks = [sum(p.numel() for p in b.parameters()) * dt for b in model.layers]
        root = (model.embed.weight.numel() + m.dim) * dt
        # between steps 1/world of it; while scoring, the root and one block gathered (with their shards)
        return {"weights": -(-weights // world), "peak": peak + root + max(blocks) * 2}
    return {"weights": weights, "peak": peak}


def memory_plan(cfg, world: int, scorer: ModelConfig | None = None) -> dict[str, int]:
    """Per-GPU bytes of a run of `world` ranks: the trainer's state, activations and peak, the
    engine's weights (dense, experts: what it holds beyond the trainer's state) and KV cache, the
    rollout phase's peak, a reward model's or judge's (scorer: its ModelConfig, `scorer_memory`) and the
    run's peak (choice 4). dtype 'auto' plans a GPU's: bf16."""
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
    trainer = trainer_memory(cfg, world, activation_checkpoint=cfg.activation_checkpoint)
    engine = engine_memory(cfg, world)
    # fp32 gradients take the shards of the fp32 parameters, between a backward and its optimizer step
    state = {"params": trainer["params"], "grads": trainer["params"], "adam": trainer["optimizer"]}
    # the rollout phase comes after an optimizer step, which set the gradients to None
    rollout = state["params"] + state["adam"] + engine["total"]
    # one process: the replica persists through training; several: the engine's weights are gathered for the
    # rollout phase and freed after it (distributed.gathered), so a training step holds none of them
    train_step = trainer["total"] + (engine["weights"] if world == 1 else 0)
    s = scorer_memory(cfg, scorer, world)  # held through the run; scoring after generating (choice 8)
    peak = max(train_step, rollout, state["params"] + state["adam"] + engine["weights"] + s["peak"]) + s["weights"]
    margins = with_margins(cfg, world, peak) - peak
    return {**state, "gathered": trainer["gathered"], "activations": trainer["activations"],
            "logits chunk": LOGITS_CHUNK_TOKENS * cfg.model.vocab_size * 4, "trainer peak": trainer["total"],
            "engine weights": engine["weights"], "engine dense": engine["dense"],
            "engine experts": engine["weights"] - engine["dense"], "engine KV": engine["kv_cache"],
            "rollout peak": rollout, "train step": train_step, "scorer weights": s["weights"],
            "scorer peak": s["peak"], "margins": margins, "total": peak + margins}


def first_update(cfg, world: int) -> dict:
    """What a GPU runs before the run's first optimizer step, at most (every row to max_new_tokens): the SFT
    steps, the eval before RL (eval_before_rl: a sampled pass of eval_samples per prompt and a greedy one) and RL
    step 0's generate rounds (stage 2's probes, then the rest of each group; over-sampling's rounds beyond). For
    each: the rows this rank generates, its decode steps (static calls of gen_batch_rows / eval_batch_rows rows
    each run to the longest row; with engine.slots each slot decodes its rows one after another) and tokens.
    Returns {"sft_steps", "passes": [(what, rows, decode steps)], "decode_steps", "tokens", "weight_bytes": what one
    decode step reads at least (the engine's dense weights and this rank's experts, `engine_bytes`)}."""
    T = cfg.sampling.max_new_tokens

    def steps(rows: int, per_call: int) -> int:
        return math.ceil(rows / (cfg.engine.slots or per_call)) * T if rows else 0

    passes = []
    if cfg.eval_before_rl:
        items = math.ceil(cfg.eval_size / world)  # rank r evaluates items r, r + world, ...
        for what, n in (("the eval's sampled pass", cfg.eval_samples), ("its greedy pass", 1)):
            passes.append((what, items * n, steps(items * n, max(1, cfg.eval_batch_rows // n) * n)))
    probe = cfg.filter.probe_size
    rounds = [("RL step 0's probes", probe), ("the rest of its groups", cfg.group_size - probe)] if probe \
        else [("RL step 0's rollouts", cfg.group_size)]
    rounds += [(f"its over-sampling round {i + 1}", cfg.group_size) for i in range(cfg.filter.oversample_rounds)]
    prompts = math.ceil(cfg.prompts_per_step / world)  # a round's prompts over the ranks (over-sampling: at most as many)
    for what, n in rounds:
        passes.append((what, prompts * n, steps(prompts * n, max(1, cfg.gen_batch_rows // n) * n)))
    if cfg.dtype == "auto":  # a GPU's: bf16
        cfg = dataclasses.replace(cfg, dtype="bfloat16")
    weights = engine_bytes(cfg, world)  # what a decode step reads at least once: the trainer's fp32 experts at ep = world
    return {"sft_steps": cfg.sft_steps, "passes": passes, "decode_steps": sum(p[2] for p in passes),
            "tokens": sum(p[1] for p in passes) * T, "weight_bytes": weights["dense"] + weights["experts"]}


def optimizer_steps(cfg) -> tuple[int, str]:
    """The optimizer steps a run takes (rl_steps x num_minibatches when every RL step trains), and why it may take
    fewer: filter.zero_variance 'drop' skips an RL step whose groups are all zero-variance, as every group is when
    the policy starts from random weights with no SFT warm-up (no init_hf, init_from or sft_steps: all wrong)."""
    n = cfg.rl_steps * cfg.num_minibatches
    if cfg.filter.zero_variance != "drop":
        return n, f"every RL step trains (filter.zero_variance={cfg.filter.zero_variance!r} keeps all-equal groups)"
    if not (cfg.init_hf or cfg.init_from or cfg.sft_steps):
        return n, ("at most: without init_hf, init_from or an SFT warm-up (sft_steps) the policy starts from random "
                   "weights, every group is all wrong and dropped as zero-variance, so likely 0; "
                   "filter.zero_variance='rl-zvp' trains on them (configs/hf_tiny.py, configs/smoke_gpu.py)")
    return n, "at most: an RL step whose groups are all zero-variance is skipped (filter.zero_variance='drop')"


def nccl_communicators(cfg, world: int) -> int:
    """NCCL communicators one rank of a `world`-rank run holds: none alone; else the default group and the
    fsdp mesh's, and the ep and efsdp meshes' where expert parallelism splits them (distributed.build_meshes;
    checkpoint saves' group is a gloo one)."""
    if world == 1:
        return 0
    ep = cfg.ep
    return 2 + (ep > 1) + (ep > 1 and world // ep > 1)


def with_margins(cfg, world: int, peak: int) -> int:
    """A rank's `peak` bytes with the margins of choice 5: the CUDA context, the NCCL communicators'
    buffers and the fragmentation reserve."""
    fixed = (CUDA_CONTEXT_GIB + NCCL_COMMUNICATOR_GIB * nccl_communicators(cfg, world)) * GB
    return int(peak * (1 + FRAGMENTATION) + fixed)


def colocated_sglang(cfg, world: int, capacity: int) -> dict[str, float]:
    """A colocated SGLang server's share of one GPU of `capacity` bytes in a `world`-rank run (choice 6):
    fraction (its mem_fraction_static: engine.sglang_mem_fraction, or 0 = the largest that fits), weights and
    kv_pool (bytes per GPU), rows (how many of the node's gen_batch_rows-per-GPU rows of prompt + completion
    tokens its pool holds at once; more queue). Raises ValueError naming the numbers when the server cannot fit
    beside the trainer or its pool holds no whole row."""
    m = cfg.model
    tp = min(world, cfg.gpus_per_node)  # one server per node, tensor parallel over the node's GPUs
    counts = param_counts(m)
    if cfg.engine.fp8:  # blockwise FP8: a byte per linear weight (1/128^2 of scales), embedding and lm_head bf16
        served = counts["total"] + counts["embed_lm_head"]
    else:
        served = 2 * counts["total"]
    weights = served / tp
    params = 4 * counts["total"] / world  # the trainer's fp32 shard, held when the server starts
    adam = 2 * params  # AdamW's moments: made by the first optimizer step, held through every rollout phase
    outside = SGLANG_OUTSIDE_POOL_GIB * GB
    rollout_margins = with_margins(cfg, world, params + adam) - (params + adam)
    largest = (capacity - adam - outside - rollout_margins) / capacity
    name = f"engine.sglang_mem_fraction={cfg.engine.sglang_mem_fraction}"
    if largest <= 0:
        raise ValueError(f"colocated SGLang cannot fit on {world} GPUs of {capacity / GB:.1f} GiB: the trainer's fp32 "
                         f"parameters and AdamW state ({(params + adam) / GB:.1f}), margins ({rollout_margins / GB:.1f}) "
                         f"and SGLang's CUDA graphs ({SGLANG_OUTSIDE_POOL_GIB:.1f}) fill the GPU before its pool: use "
                         f"more nodes, or external servers (engine.sglang_urls)")
    fraction = cfg.engine.sglang_mem_fraction or math.floor(largest * 100) / 100  # as a flag is written, rounded down
    if fraction > largest:
        raise ValueError(f"{name} leaves {(1 - fraction) * capacity / GB:.1f} GiB of a {capacity / GB:.1f} GiB GPU "
                         f"beside colocated SGLang's pool, and the trainer's AdamW state ({adam / GB:.1f}), margins "
                         f"({rollout_margins / GB:.1f}) and SGLang's CUDA graphs ({SGLANG_OUTSIDE_POOL_GIB:.1f}) need "
                         f"{(adam + rollout_margins + outside) / GB:.1f}: set at most {largest:.2f}, or 0 to take it "
                         f"from the plan")
    kv_pool = fraction * capacity - params - weights
    # k and v of a token, every layer, this GPU's share of the KV heads (replicated where tp exceeds them)
    kv_token = m.n_layers * 2 * max(1, m.n_kv_heads // tp) * m.head_dim * 2
    rows = int(kv_pool // (kv_token * (cfg.prompt_limit() + cfg.sampling.max_new_tokens)))
    if rows < 1:
        raise ValueError(f"colocated SGLang cannot fit on {world} GPUs of {capacity / GB:.1f} GiB: at "
                         f"mem_fraction_static {fraction:.2f} its pool of {fraction * capacity / GB:.1f} GiB holds the "
                         f"trainer's fp32 parameters ({params / GB:.1f}) and the served weights ({weights / GB:.1f}) "
                         f"and leaves {max(kv_pool, 0) / GB:.1f} for the KV cache, less than one row of "
                         f"{cfg.prompt_limit() + cfg.sampling.max_new_tokens} tokens: use more nodes, engine.fp8=True, "
                         f"or external servers (engine.sglang_urls)")
    return {"fraction": fraction, "weights": weights, "kv_pool": kv_pool,
            "rows": min(rows, cfg.gen_batch_rows * tp), "node_rows": cfg.gen_batch_rows * tp}


def print_plan(cfg, nodes=NODES, scorer: ModelConfig | None = None) -> list[dict]:
    """Print parameter counts and the per-GPU plan for each node count, with a reward model's or judge's line
    (scorer: its ModelConfig, counted in the totals); return the plan rows (GiB). Raises ValueError if ep
    divides none of the GPU counts."""
    counts = param_counts(cfg.model)

    def n(x):
        return f"{x / 1e9:.2f}B" if x >= 1e8 else f"{x / 1e6:.2f}M"

    print(f"parameters: {n(counts['total'])} total, {n(counts['active'])} active per token "
          f"({n(counts['active'] - counts['embed_lm_head'])} without embedding and lm_head), "
          f"{n(counts['experts'])} in routed experts")
    dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    rows = (f"{cfg.engine.slots} rows per GPU at once (engine.slots: continuous batching, whatever gen_batch_rows) "
            f"in KV pages of {kv_columns(cfg):,} tokens (engine.kv_tokens)," if cfg.engine.slots
            else f"{cfg.gen_batch_rows} rows per GPU")
    print(f"per GPU (GiB): {cfg.microbatch_tokens}-token micro-batches in {dtype}, activation checkpointing "
          f"{'on' if cfg.activation_checkpoint else 'off'}; the engine generating {rows} "
          f"of at most {cfg.prompt_limit()} + {cfg.sampling.max_new_tokens} tokens, on one GPU from a full copy of the weights kept "
          f"through training, on several from the policy's own: dense weights gathered for the rollout phase, "
          f"experts E/ep per GPU")
    cols = ["params", "grads", "adam", "gathered", "activations", "logits chunk", "trainer peak", "engine dense",
            "engine experts", "engine KV", "rollout peak", "margins", "total"]
    print(f"{'nodes':>5} {'GPUs':>5} {'ep':>3}  " + "  ".join(f"{c:>{max(9, len(c))}}" for c in cols) + "  fits")
    rows, plans = [], {}
    for k in nodes:
        world = k * cfg.gpus_per_node
        if world % cfg.ep or cfg.model.num_experts % cfg.ep:
            print(f"{k:>5} {world:>5}  ep={cfg.ep} does not divide {world} GPUs and {cfg.model.num_experts} experts")
            continue
        plan = memory_plan(cfg, world, scorer)
        fits = [name for name, gib in GPU_MEMORY_GIB.items() if plan["total"] / GB <= gib]
        print(f"{k:>5} {world:>5} {cfg.ep:>3}  " + "  ".join(f"{plan[c] / GB:>{max(9, len(c))}.1f}" for c in cols)
              + f"  {', '.join(fits) or 'no'}")
        rows.append({"nodes": k, "gpus": world, **{c: plan[c] / GB for c in [*cols, "engine weights", "train step"]},
                     "fits": fits})
        plans[k] = plan
    if not rows:
        raise ValueError(f"ep={cfg.ep} divides none of the GPU counts {[k * cfg.gpus_per_node for k in nodes]}")
    if scorer is not None:  # whole on each rank (choice 8), or with rm_shard 1/world of it
        world = rows[0]["gpus"]
        s = scorer_memory(cfg, scorer, world)
        where = f"sharded over the GPUs (reward.rm_shard; the figures at {world})" if cfg.reward.rm_shard else "whole on every GPU"
        print(f"reward.model={cfg.reward.model}: {n(param_counts(scorer)['total'])} parameters, {where}; "
              f"weights {s['weights'] / GB:.1f} GiB held through the run, scoring peak {s['peak'] / GB:.1f} GiB after "
              f"generating; both in each total above")
    _print_what_fits(cfg, plans)
    _print_first_update(cfg, plans)
    if cfg.engine.name == "sglang" and not cfg.engine.urls:
        _print_colocated_sglang(cfg, plans)
    other = not cfg.activation_checkpoint  # activations do not depend on the world size: once, at the first
    acts = trainer_memory(dataclasses.replace(cfg, dtype=dtype), rows[0]["gpus"], activation_checkpoint=other)
    print(f"activation checkpointing {'on' if other else 'off'} would make activations "
          f"{acts['activations'] / GB:.1f} GiB and the trainer's peak {acts['total'] / GB:.1f} GiB on {rows[0]['gpus']} GPUs")
    return rows


def _print_what_fits(cfg, plans: dict[int, dict]):
    """Per node count: which phase sets the peak and its parts, and for each GPU type it does not fit what
    would: fewer rows per generate call (gen_batch_rows, eval_batch_rows; engine.slots when the engine batches
    continuously) where the rollout phase sets the peak (its KV cache and prefill shrink), else more nodes."""
    bf16 = dataclasses.replace(cfg, dtype="bfloat16") if cfg.dtype == "auto" else cfg
    for k, p in plans.items():
        world = k * cfg.gpus_per_node
        if p["train step"] >= p["rollout peak"]:
            where = f"the training step's (fp32 params, grads and AdamW {(2 * p['params'] + p['adam']) / GB:.1f})"
        else:
            own = " (dense; ep = GPUs: its experts are the trainer's fp32 shards)" \
                if _experts_are_trainer_shards(cfg, world) else ""
            where = (f"the rollout phase's (fp32 params and AdamW {(p['params'] + p['adam']) / GB:.1f}, engine weights "
                     f"{p['engine weights'] / GB:.1f}{own}, KV cache {p['engine KV'] / GB:.1f})")
        needs = []
        for name, gib in GPU_MEMORY_GIB.items():
            if p["total"] / GB <= gib:
                continue
            if with_margins(cfg, world, p["train step"] + p["scorer weights"]) / GB > gib:
                needs.append(f"{name}: more nodes")
                continue
            slots = bf16.engine.slots  # continuous batching: its slots bound the live rows (choice 7)
            rows = (slots if slots else max(bf16.gen_batch_rows, bf16.eval_batch_rows)) // 2
            while rows >= 1:  # the rollout phase sets this peak, the training step fits: fewer rows per call
                if slots:  # the pages shrink with the slots (kv_tokens per slot kept), down to the least pool
                    kv = bf16.engine.kv_tokens * rows // slots
                    if kv and too_few_pages(kv, bf16.prompt_limit(), bf16.sampling.max_new_tokens,
                                            bf16.engine.page_size):
                        rows = 0  # no smaller pool holds a row: the loop's else says more nodes
                        continue
                    smaller = dataclasses.replace(bf16, engine=dataclasses.replace(bf16.engine, slots=rows, kv_tokens=kv))
                    change = f"engine.slots={rows}" + (f" engine.kv_tokens={kv}" if kv else "")
                else:
                    smaller = dataclasses.replace(bf16, gen_batch_rows=min(rows, bf16.gen_batch_rows),
                                                  eval_batch_rows=min(rows, bf16.eval_batch_rows))
                    change = f"gen_batch_rows={smaller.gen_batch_rows} eval_batch_rows={smaller.eval_batch_rows}"
                rollout = p["params"] + p["adam"] + engine_memory(smaller, world)["total"]
                scoring = p["params"] + p["adam"] + p["engine weights"] + p["scorer peak"]  # choice 8
                total = with_margins(cfg, world, max(rollout, p["train step"], scoring) + p["scorer weights"])
                if total / GB <= gib:
                    needs.append(f"{name}: {change} ({total / GB:.1f})")
                    break
                rows //= 2
            else:
                needs.append(f"{name}: more nodes")
        print(f"{k:>5} node{'s' if k > 1 else ' '}: peak {p['total'] / GB:.1f} GiB, {where}"
              + (f"; to fit {', '.join(needs)}" if needs else ""))


def _print_first_update(cfg, plans: dict[int, dict]):
    """The optimizer steps the run takes, and per node count what comes before the first: decode steps and tokens
    per GPU (`first_update`), and a floor on their time from the engine's weights read once per decode step."""
    n, why = optimizer_steps(cfg)
    print(f"optimizer steps: {n} = rl_steps {cfg.rl_steps} x num_minibatches {cfg.num_minibatches}, {why}")
    first = first_update(cfg, next(iter(plans)) * cfg.gpus_per_node)
    print("before the first RL update, per GPU, every row to max_new_tokens: "
          + (f"the SFT warm-up's {cfg.sft_steps} steps, " if cfg.sft_steps else "")
          + ", ".join(what for what, _, _ in first["passes"])
          + (" (eval_before_rl=False skips the eval)" if cfg.eval_before_rl else ""))
    print(f"{'nodes':>5} {'decode steps':>13} {'tokens':>13}  at least (the weights a decode step reads, once a step at "
          f"full HBM bandwidth; prefill, KV reads and all-to-alls come on top: bench/gpu.py times decoding)")
    for k in plans:
        f = first_update(cfg, k * cfg.gpus_per_node)
        floor = ", ".join(f"{_duration(f['decode_steps'] * f['weight_bytes'] / bw)} on {name.split()[0]}"
                          for name, bw in HBM_BYTES_PER_S.items())
        print(f"{k:>5} {f['decode_steps']:>13,} {f['tokens']:>13,}  {floor}")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _print_colocated_sglang(cfg, plans: dict[int, dict]):
    """Per node count and GPU type, the colocated SGLang server's fraction, KV pool and rows held, or why not."""
    for k in plans:
        world, parts = k * cfg.gpus_per_node, []
        for name, gib in GPU_MEMORY_GIB.items():
            try:
                s = colocated_sglang(cfg, world, int(gib * GB))
                parts.append(f"{name}: mem_fraction_static {s['fraction']:.2f}, KV pool {s['kv_pool'] / GB:.1f} GiB "
                             f"({s['rows']} of the node's {s['node_rows']} rows at once)")
            except ValueError as e:
                parts.append(f"{name}: {e}")
        print(f"{k:>5} node{'s' if k > 1 else ' '}: colocated SGLang, " + "; ".join(parts))
