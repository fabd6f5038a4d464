"""Rollout engines: the interface an RL step uses, their registry, and the native engine.

This file owns the rollout side of an RL step: `Engine` (the protocol both engines implement:
generate, update_weights, phase, sleep, wake, memory, counters, weight_version), `ENGINES` (name ->
builder, what engine.name picks) with `build_engine`, the async producer's `producer_engine` and a
generative judge's own engine (`judge_generator`), and `NativeEngine` (prefill and decode over a static KV
cache in plain PyTorch, CPU or GPU, on its own copy of the weights or on the sharded policy itself), with its
bucketed weight sync.
`SGLangEngine` (sglang_engine.py) is the other engine. Both return sampler.Rollout records,
sampled by sampler.sample from per-row random streams; FP8 weights come from weights.py.

Sources: router replay (R3, arXiv 2510.11370), for which every rollout records its routed
experts; blockwise FP8 after DeepSeek-V3 (arXiv 2412.19437, section 3.3); gpt-fast's pure
prefill / decode over a static cache. The train-inference gap of the logprobs and routes
recorded here is measured by `espo.mismatch_metrics`.

Shapes: U, B, S, C, T, L, K, E, D, J, d, V (letters of the README's legend). In a generate
call T is the longest prompt's tokens (the prefill's positions), so the first sampled token
lands in cache column T. The KV cache (model.KVCache, [layers, B, J, S, d]) spans every
layer, dense ones included. The argument n is the README's G.

Notable choices:

1. Prefill once per distinct prompt (gpt-fast style). Each unique prompt is prefilled once
   through the model's own forward, left-padded so that every prompt ends at column T - 1;
   its KV cache is copied to its n sample rows. Decoding then writes column T + t at step t
   of a static cache allocated once, S = T + max_new_tokens - 1 columns (the last sampled
   token is never fed back), addressed by column, not by per-row length.
2. The decode step is the model's own forward (`Transformer.hidden`) for one token per row,
   with the cache and a row mask: the same modules, routing and attention as the prefill
   and the trainer, so what the trainer replays is what the engine computed. Per step
   nothing is allocated beyond activations, no shape depends on data, the host syncs only
   for the stop check every `STOP_CHECK_EVERY` steps, and no Python loop runs over rows.
   `torch.compile` of the step is optional: it pays where per-op launch cost dominates, on
   GPU; on a CPU decode step the expert GEMMs dominate.
3. Batch-invariant sampling (sampler.py): temperature / top-k / top-p with one uniform per
   row per step, from a counter-based stream keyed by (seed, group id, sample index): a
   rollout never depends on its batch-mates, their order or the rank that generated it.
   Each row stops on its own first stop token (EOS, or any of a chat model's several).
4. What a `Rollout` records, for the trainer: the logprob of each sampled token under
   softmax(logits / temperature) before top-k/top-p truncation (what the trainer computes
   for the same token); the top-k expert ids every MoE layer used for every token that
   went through the model, in SGLang's layout [T + C - 1, L, K] (the last sampled token is
   never fed back), for router replay; and the weight version that produced it.
5. FP8 weights (engine.fp8): blockwise e4m3 modules and the trainer-side
   quantiser, DeepSeek-V3's recipe, live in weights.py; a high-precision tensor sent for an
   FP8 weight is quantised on arrival.
6. Weight sync in buckets of at most DEFAULT_BUCKET_BYTES (`weight_buckets`), each staged as one
   flat copy per dtype (`_stage`): staging memory stays bounded and a sync is a few large
   transfers, not one per tensor.
7. Continuous batching, off by default (engine.slots, `batching.ContinuousBatch`): at
   most `slots` rows decode at once, each slot at its own cache columns (in pages: paged_kv.PagedKVCache), and a
   stopped row's slot and pages take the next row of the call, its prompt's prefill shared. The same sampling
   streams, so the same tokens and routes as one static call; a long-tailed call then runs its
   rows in far fewer decode row-steps than static calls of N rows (bench/continuous.py). On the
   sharded policy the ranks keep lockstep: one collective per admission round or decode step picks
   the same next forward on every rank (a rank with nothing to admit prefills a placeholder, one
   whose rows are done steps idle slots) until every rank's rows are done, and the decode steps run
   under `ep_decode.capacity_dispatch(model, slots)`: fixed-size all-to-alls, no host sync per MoE layer.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn as nn

from engines.batching import ContinuousBatch, EngineParts
from config import EngineConfig
from distributed import (all_ranks, collective_group, gathered, load_shards, own_meshes, rank_world,
                         reference_copy, set_group_timeouts)
from model import KVCache, ModelConfig, Transformer, route_dtype
from sampler import Rollout, SamplingParams, Vocab, row_keys, row_uniforms, sample
from sglang_engine import build_sglang_engine, stop_launched_servers
from tool_rollout import ToolEngine
from weights import (DEFAULT_BUCKET_BYTES, FP8, FP8GroupedExperts, FP8Linear, Named, full_tensor, local,
                     policy_tensors, quantize_fp8_blockwise, to_fp8_modules, weight_buckets)

if TYPE_CHECKING:
    from config import TrainConfig
    from tokenizer import Tokenizer

STOP_CHECK_EVERY = 8
"""Decode steps between checks that every row has stopped (each check syncs a GPU)."""


# ----------------------------------------------------------------------------- native engine

def _stage(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bucket on `device`: one flat copy per dtype when it lives elsewhere (one transfer, not one per tensor)."""
    if all(t.device == device for _, t in bucket):
        return bucket
    out = {}
    for dtype in {t.dtype for _, t in bucket}:  # torch.cat takes one dtype: one flat buffer per dtype
        part = [(n, t) for n, t in bucket if t.dtype == dtype]
        # (sum of numels,) flat; to a GPU engine the destinations' copy_ is ordered after it on the same stream
        flat = torch.cat([t.detach().reshape(-1) for _, t in part]).to(device, non_blocking=True)
        for (n, t), piece in zip(part, flat.split([t.numel() for _, t in part])):
            out[n] = piece.view(t.shape)  # split and view: no copy on this side
    return [(n, out[n]) for n, _ in bucket]  # back in the bucket's order


@dataclass
class DecodeState:
    """What the decode steps of one generate call read and write, allocated once (no shape depends on data)."""
    cache: KVCache  # every row's KV cache, [layers, B, J, S, d]: the prompt's columns copied from its prefill,
    # column T + t written by decode step t
    pos_BS: torch.Tensor  # RoPE position of each row's columns (left padding shifts a row's positions)
    bias_B11S: torch.Tensor  # fp32 additive mask: 0 on a row's real columns, -inf on its left padding
    routes_BSLK: torch.Tensor  # routed experts (route_dtype) of every token fed to the model


def decode_step(model: Transformer, tokens_B: torch.Tensor, state: DecodeState, col: int) -> torch.Tensor:
    """Logits [B, V] fp32 of the next token after feeding tokens_B at cache column col.

    The model's own forward (`Transformer.hidden`) for one token per row over the static cache:
    the same modules and routing as the prefill and the trainer, attention over columns
    [0, col] (`ops.single_query_attention`). Writes this token's keys and values at column
    col of every layer and its routed experts into state.routes_BSLK.
    """
    h_B1D, routes_B1LK = model.hidden(tokens_B[:, None], pos_BT=state.pos_BS[:, col:col + 1], return_routes=True,
                                      cache=state.cache, cache_start=col, mask_B1TS=state.bias_B11S[..., :col + 1])
    state.routes_BSLK[:, col] = routes_B1LK[:, 0]  # (B, L, K) int64 -> route_dtype: the experts this token used
    return model.lm_head(h_B1D[:, 0]).float()  # (B, V) fp32 for the sampler


class NativeEngine:
    """A PyTorch rollout engine (an `Engine`): its own copy of the policy weights (optionally FP8) in one
    process, or, given `policy` (a multi-rank run's FSDP/EP-sharded model), no copy at all.

    On the sharded policy (distributed.gathered): for each rollout phase (`phase()`; a generate call
    outside one opens its own) the dense weights are gathered once and freed after it, the experts
    stay expert-parallel with the training all-to-all, and every rank decodes its own rows; ranks
    step in lockstep (the stop check is a collective) because each forward's all-to-all needs all
    of them, and a rank without prompts decodes one placeholder row. Weight sync is free: the engine
    reads the tensors the optimizer just wrote. The KV cache is this rank's, in the run's dtype.
    group: the process group of the phase's collectives (None: the default one); the async producer's
    engine, on a sharded copy of the policy, has groups of its own (`producer_engine`).
    options: the run's engine section (config.EngineConfig, checked when built; the defaults without one): fp8
    (blockwise-FP8 weights, one process) and continuous batching: slots = 0 decodes every row of a call in one
    static batch until the last one stops; slots > 0 decodes at most that many rows at once, refilling a stopped
    row's slot (`ContinuousBatch`, over a paged KV cache: page_size, kv_tokens, prefill_tokens; cuda_graph), on the sharded
    policy in lockstep with the other ranks. `batch_stats` then holds the last call's counts.
    """

    def __init__(self, cfg: ModelConfig, vocab: Vocab, *, device="cpu", dtype=torch.float32, compile: bool = False,
                 policy: nn.Module | None = None, group=None, options: EngineConfig | None = None):
        # vocab.num_tokens: ids past the tokenizer's (a checkpoint's padded embedding rows) are never sampled, so no
        # id the tokenizer cannot decode; their probability mass (nil in a trained model) is what the engine's
        # logprobs then differ by from the trainer's
        self.cfg, self.vocab = cfg, vocab
        self.stop_ids, self.pad_id = vocab.stop_ids, vocab.pad_id
        self.num_tokens, self.decode = vocab.num_tokens, vocab.decode
        self.options = options or EngineConfig()
        self.device, self.dtype, self.group = torch.device(device), dtype, group
        self.fp8, self.slots = self.options.fp8, self.options.slots  # the two the engine branches on
        self.weight_version, self.sharded, self._phase = 0, policy is not None, None
        self.kv_bytes = 0  # the largest KV cache a generate call of this phase allocated (the run logs it)
        self.kv_live_bytes = 0  # with slots: the most of its pages the rows of a call in this phase held at once
        self.preemptions = 0  # with slots: rows preempted for pages in this phase (ContinuousBatch's choice 6)
        self._decode_step = torch.compile(decode_step, dynamic=True) if compile else decode_step
        self.batch_stats: dict[str, int] = {}  # the last continuous call's counts (ContinuousBatch.stats)
        if policy is not None:  # no FP8 on the sharded policy (config.RELATIONS refuses engine.fp8 on several ranks)
            self.model = policy  # the trainer's own module: nothing to copy, nothing to sync
            return
        # no gradients, ever; the initial values are placeholders until the first update_weights
        self.model = Transformer(cfg).to(self.device, dtype).eval().requires_grad_(False)
        for block in self.model.layers:
            if block.is_moe:
                block.mlp.gate.float()  # the router's weight stays fp32 in any engine dtype, as in the trainer
        if self.fp8:  # after .to(dtype), which would otherwise cast the e4m3 buffers back to dtype
            to_fp8_modules(self.model, dtype)
        self.weight_version = 0
        named = list(self.model.named_parameters(remove_duplicate=False)) + list(self.model.named_buffers())
        self._tensors = dict(named)  # every name a trainer may send, tied names included
        persistent = set(self.model.state_dict())  # non-persistent buffers (softmax router's expert_bias) need not come
        # what every sync must bring: each parameter once (tied ones under one name) and each persistent buffer
        self._required = {n for n, _ in list(self.model.named_parameters()) + list(self.model.named_buffers())
                          if n in persistent}
        self._fp8_weights = {n for n, t in self._tensors.items() if t.dtype == FP8}  # quantise these on arrival

    @contextmanager
    def phase(self):
        """A rollout phase: on the sharded policy the weights stay gathered across every generate call
        inside it (a collective: every rank enters and leaves together), and this thread's collectives
        (distributed.py's) run on the engine's group. kv_bytes counts from its start, so what a step
        reports does not depend on what ran before it (a resumed run's too)."""
        if self._phase is not None:  # already inside one
            yield
            return
        self.kv_bytes = self.kv_live_bytes = self.preemptions = 0
        if not self.sharded:
            self._phase = {}
            try:
                yield
            finally:
                self._phase = None
            return
        with collective_group(self.group), gathered(self.model):
            self._phase = weight_bytes(self.model)  # measured while gathered: what decoding holds
            try:
                yield
            finally:
                self._phase = None

    def sleep(self):
        """Nothing to release: an SGLang engine gives its memory back while the trainer trains."""

    def wake(self):
        """Nothing to resume (see sleep)."""

    def memory(self) -> dict[str, int]:
        """Bytes this rank's engine holds: its weights (dense and routed experts; on the sharded policy
        the gathered ones, which live only during a rollout phase), its largest KV cache in this phase and,
        with slots, kv_live: the most of a call's pages its rows (and held prompts) used at once, what to size
        engine.kv_tokens by."""
        if self.sharded:
            with self.phase():
                weights = dict(self._phase)
        else:
            weights = weight_bytes(self.model)
        live = {"kv_live": self.kv_live_bytes} if self.slots else {}
        return {**weights, "kv_cache": self.kv_bytes, **live}

    def counters(self) -> dict[str, int]:
        """What this rank's engine counted in this phase: with slots, the rows preempted for pages (engine.kv_tokens
        too small for the step's live tokens)."""
        return {"preemptions": self.preemptions} if self.slots else {}

    @torch.no_grad()
    def update_weights(self, named_tensors: Named, version: int):
        """Copy the trainer's tensors in, bucket by bucket (`policy_tensors(model)`, or the
        `quantize_fp8` of it for an FP8 engine; a high-precision tensor sent for an FP8
        weight is quantised on arrival). Every parameter and persistent buffer must arrive.

        Raises ValueError on an unknown name, a shape mismatch or a missing tensor.
        On the sharded policy nothing moves: the engine already reads the trainer's tensors (a sharded
        copy of it, the async producer's, copies each of this rank's shards, with no communication).
        """
        if self.sharded:
            load_shards(self.model, dict(named_tensors))
            self.weight_version = version
            return
        seen = set()
        # a DTensor shard (FSDP, EP) is gathered whole (the engine holds unsharded weights), then cast to its
        # destination's dtype before any transfer: a bf16 engine receives bf16 bytes
        named_tensors = ((n, self._as_dest(n, full_tensor(t))) for n, t in named_tensors)
        for bucket in weight_buckets(named_tensors, DEFAULT_BUCKET_BYTES):
            for name, t in _stage(bucket, self.device):
                dest = self._tensors.get(name)
                if dest is None:
                    raise ValueError(f"update_weights: unknown tensor {name!r}")
                if dest.shape != t.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(dest.shape)}")
                if name in self._fp8_weights and t.dtype != FP8:
                    q, s = quantize_fp8_blockwise(t)  # the same blocks as quantize_fp8 on the trainer's side
                    self._tensors[name + "_scale_inv"].copy_(s)
                    t = q
                    seen.add(name + "_scale_inv")
                dest.copy_(t)  # in place: the modules (and a compiled decode step) keep holding the same tensors
                seen.add(name)
        if missing := self._required - seen:
            raise ValueError(f"update_weights: missing {sorted(missing)[:5]} ({len(missing)} in all)")
        for module in self.model.modules():
            if isinstance(module, (FP8Linear, FP8GroupedExperts)):
                module.refresh()  # the cached dequantised weights follow the new values
        self.weight_version = version  # stamped on every Rollout generated from now on

    def _as_dest(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t in its destination's floating dtype (an FP8 destination takes high precision and quantises it on
        arrival)."""
        dest = self._tensors.get(name)
        if dest is None or dest.dtype == FP8 or not t.is_floating_point() or t.dtype == FP8:
            return t
        return t.to(dest.dtype)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]:
        """n rollouts of each prompt under `params`, returned prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]).

        Each distinct prompt is prefilled once; its rows share that prefill. Sampling is
        batch-invariant: sample j of group g draws from its own random stream keyed by
        (seed, g, j) (`row_keys`), so it does not depend on the other prompts in the call
        or their order (pass global group_ids to split a batch across calls or ranks and
        sample the same tokens, up to the float rounding of differently shaped matmuls).
        group_ids: one per prompt (default 0..len-1), copied into `Rollout.group_id`.
        seed None draws one from torch's global RNG.
        Raises ValueError on an empty prompt, max_new_tokens < 1, or a prompt that cannot
        fit max_new_tokens within max_seq_len.
        """
        if self.sharded:  # lockstep with the other ranks, inside a rollout phase
            with self.phase():
                if not prompts:
                    self._generate([[self.pad_id]], params, 1, 0, None)  # joins the others' collectives; dropped
                    return []
                rollouts = self._generate(prompts, params, n, seed, group_ids)
        else:
            rollouts = self._generate(prompts, params, n, seed, group_ids)
        if self.decode is not None:
            for r in rollouts:
                r.text = self.decode(r.text_ids)
        return rollouts

    def _generate(self, prompts, params, n, seed, group_ids) -> list[Rollout]:
        if not prompts:
            return []
        max_new_tokens = params.max_new_tokens  # >= 1: SamplingParams checks it
        lens = [len(p) for p in prompts]
        if min(lens) == 0 or max(lens) + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt lengths span [{min(lens)}, {max(lens)}] with max_new_tokens={max_new_tokens}; "
                             f"need prompts >= 1 token and prompt + max_new_tokens <= max_seq_len = {self.cfg.max_seq_len}")
        if seed is None:  # an unseeded call still varies from call to call, through torch's global RNG
            seed = int(torch.randint(1 << 62, (1,)))
        groups = group_ids if group_ids is not None else list(range(len(prompts)))  # each prompt's group id
        if len(groups) != len(prompts):
            raise ValueError(f"group_ids has {len(groups)} entries for {len(prompts)} prompts")
        # row i = sample i % n of prompt i // n; its random stream is keyed by (seed, group, sample)
        keys_B = row_keys(seed, [g for g in groups for _ in range(n)], [j for _ in prompts for j in range(n)], self.device)
        if self.slots:
            batch = ContinuousBatch(self.parts(), prompts, n, params, keys_B)
            self.kv_bytes = max(self.kv_bytes, batch.kv_bytes)
            rollouts = batch.run(groups, self.weight_version)
            # what the call counted, this phase's (memory() and counters() report them)
            self.kv_live_bytes = max(self.kv_live_bytes, batch.kv_live_bytes)
            self.preemptions += batch.stats["preemptions"]
            self.batch_stats = batch.stats
            return rollouts
        T = max(lens)  # the longest prompt: every row's first sampled token lands in column T
        last_BV, state, pad_B = self._prefill(prompts, n, max_new_tokens)
        ids_BC, logp_BC, steps = self._decode(last_BV, state, keys_B, params, T)
        ids = ids_BC[:, :steps].tolist()  # columns past `steps` were never sampled
        # one device-to-host copy per tensor; the per-row slicing below then runs on the CPU
        logp_BC, routes_BSLK, pads = logp_BC.float().cpu(), state.routes_BSLK.cpu(), pad_B.tolist()
        rollouts = []
        for i, row in enumerate(ids):
            # the first stop token ends the completion and belongs to it
            c = next((j + 1 for j, tok in enumerate(row) if tok in self.stop_ids), None)
            stop = c is not None
            c = c or steps
            # routes: columns [pad, T + c - 1) = the row's prompt and all but its last completion token, i.e. the
            # tokens fed to the model; clone() so a rollout does not keep the whole batch's tensor alive
            rollouts.append(Rollout(
                prompt_ids=list(prompts[i // n]), completion_ids=row[:c], logprobs=logp_BC[i, :c].clone(),
                routes=routes_BSLK[i, pads[i]:T + c - 1].clone(), finish_reason="stop" if stop else "length",
                group_id=groups[i // n], weight_version=self.weight_version))
        return rollouts

    def parts(self) -> EngineParts:
        """What a continuous call (batching.ContinuousBatch) uses of this engine: its model, options, prefill
        (`prefill_prompts`), device, dtype, token ids and whether it decodes on the sharded policy."""
        return EngineParts(model=self.model, options=self.options, prefill=self.prefill_prompts, device=self.device,
                           dtype=self.dtype, pad_id=self.pad_id, stop_ids=self.stop_ids, num_tokens=self.num_tokens,
                           sharded=self.sharded)

    def prefill_prompts(self, uprompts: list[tuple]):
        """One forward over distinct prompts, left-padded to the longest (T) so each ends at column T - 1.
        Returns their KVCache [layers, U, J, T, d], last-token logits [U, V] fp32, routes [U, T, L, K]
        (int64) and left padding [U] (a batching.Prefill)."""
        cfg, dev = self.cfg, self.device
        U, T = len(uprompts), max(len(p) for p in uprompts)
        pad_U = torch.tensor([T - len(p) for p in uprompts], device=dev)  # (U,) left padding, so all end at T - 1
        tokens_UT = torch.full((U, T), self.pad_id, dtype=torch.long, device=dev)
        for u, p in enumerate(uprompts):
            tokens_UT[u, T - len(p):] = torch.tensor(p, device=dev)  # right-aligned
        col_T = torch.arange(T, device=dev)
        key_ok_UT = col_T[None] >= pad_U[:, None]  # left padding is never attended to
        causal_TT = col_T[:, None] >= col_T[None]  # (T, T): query column >= key column
        # pad queries may see themselves so their softmax rows are not empty
        mask_U1TT = (causal_TT & (key_ok_UT[:, None] | torch.eye(T, dtype=torch.bool, device=dev)))[:, None]
        prefill = KVCache(cfg, U, T, dtype=self.dtype, device=dev)  # (n_layers, U, J, T, d): a row per distinct prompt
        # positions count from each prompt's first real token (pads at 0, masked anyway): RoPE sees what the
        # trainer's unpadded forward sees
        h_UTD, routes_UTLK = self.model.hidden(tokens_UT, pos_BT=(col_T[None] - pad_U[:, None]).clamp(min=0),
                                               return_routes=True, cache=prefill, cache_start=0, mask_B1TS=mask_U1TT)
        # (U, V): column T - 1 holds every prompt's last token; hidden() has applied the final norm
        return prefill, self.model.lm_head(h_UTD[:, -1]).float(), routes_UTLK, pad_U

    def _prefill(self, prompts: list[list[int]], n: int, max_new_tokens: int):
        """Prefill each distinct prompt once, left-padded so every row's next token lands in column T,
        and allocate the decode state of its n rows. Returns the first logits [B, V] fp32, the
        DecodeState and each row's left padding [B]."""
        cfg, dev = self.cfg, self.device
        unique: dict[tuple, int] = {}
        for p in prompts:
            unique.setdefault(tuple(p), len(unique))  # first-seen order; a repeated prompt is prefilled once
        uprompts = list(unique)
        row_u = torch.tensor([unique[tuple(p)] for p in prompts for _ in range(n)], device=dev)  # (B,) row -> U index
        B, T = len(row_u), max(len(p) for p in prompts)
        S = T + max_new_tokens - 1  # the last sampled token is never fed back
        prefill, last_UV, routes_UTLK, pad_U = self.prefill_prompts(uprompts)
        last_BV = last_UV[row_u]  # (U, V) -> (B, V)

        # (n_layers, B, J, S, d): columns >= T are written by decode step t = col - T before any read
        cache = KVCache(cfg, B, S, dtype=self.dtype, device=dev)
        self.kv_bytes = max(self.kv_bytes, 2 * cache.k.numel() * cache.k.element_size())
        for layer in range(cfg.n_layers):  # each row copies its prompt's prefill, a layer at a time: (B, J, T, d)
            # per layer, so the gathered copy in between is one layer's, not the whole cache's
            cache.k[layer, :, :, :T] = prefill.k[layer, row_u]
            cache.v[layer, :, :, :T] = prefill.v[layer, row_u]
        # the Rollout's dtype (route_dtype); columns past a row's last fed token are never read
        routes_BSLK = torch.empty(B, S, cfg.num_moe_layers, cfg.top_k, dtype=route_dtype(cfg.num_experts), device=dev)
        routes_BSLK[:, :T] = routes_UTLK[row_u]  # (U, T, L, K) -> (B, T, L, K)
        pad_B = pad_U[row_u]  # (B,)
        col_S = torch.arange(S, device=dev)
        pos_BS = (col_S[None] - pad_B[:, None]).clamp(min=0)  # (B, S): each row's positions, as in the prefill
        # (B, 1, 1, S), broadcast over heads: the row's left padding is never attended to
        bias_B11S = torch.zeros(B, 1, 1, S, device=dev).masked_fill_((col_S[None] < pad_B[:, None])[:, None, None],
                                                                     float("-inf"))
        state = DecodeState(cache, pos_BS, bias_B11S, routes_BSLK)
        return last_BV, state, pad_B

    def _decode(self, last_BV: torch.Tensor, state: DecodeState, keys_B: torch.Tensor, params: SamplingParams, T: int):
        """Sample and feed back one token per row per step until every row has stopped or the limit is
        reached. Returns ids [B, C] int64 (padding after a row's EOS), their logprobs [B, C] and the steps run."""
        B, C, dev = last_BV.shape[0], params.max_new_tokens, self.device
        ids_BC = torch.full((B, C), self.pad_id, dtype=torch.long, device=dev)
        logp_BC = torch.zeros(B, C, device=dev)
        done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=dev)
        for t in range(C):
            # draw t of each row's own stream: the same whichever rows share this batch
            if self.num_tokens is not None and self.num_tokens < last_BV.shape[1]:
                last_BV[:, self.num_tokens:] = float("-inf")  # the padding rows of the vocabulary
            ids_B, logp_B = sample(last_BV, params, row_uniforms(keys_B, t))
            ids_B = ids_B.masked_fill_(done_B, self.pad_id)  # finished rows emit padding
            ids_BC[:, t] = ids_B
            logp_BC[:, t] = logp_B
            done_B |= torch.isin(ids_B, stops)  # a finished row still runs (no shape depends on data); generate cuts it
            # the only host sync of a step: every STOP_CHECK_EVERY steps, whether all rows are done
            if t == C - 1 or (t % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1 and self._all_done(done_B)):
                break  # no decode step after the last sample: it is never fed back
            last_BV = self._decode_step(self.model, ids_B, state, T + t)  # completion token t sits at column T + t
        return ids_BC, logp_BC, t + 1

    def _all_done(self, done_B: torch.Tensor) -> bool:
        """Every row has stopped: this rank's, or on the sharded policy every rank's (all decode in lockstep)."""
        if not self.sharded:
            return bool(done_B.all())
        return all_ranks(bool(done_B.all()))



def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights an engine decodes with: "dense" (every tensor but the routed experts) and
    "experts" (this rank's routed experts), each at its own dtype: a replica's are in the engine dtype
    (router gates fp32), a gathered policy's in FSDP's param dtype, and a DTensor counts its local
    shard (this rank's experts under expert parallelism). The plan's engine_bytes computes the same
    from the shapes."""
    out = {"dense": 0, "experts": 0}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        shard = local(t)
        out["experts" if ".mlp.experts." in name else "dense"] += shard.numel() * shard.element_size()
    return out


# ----------------------------------------------------------------------------- the engine interface

class Engine(Protocol):
    """What an RL step asks of a rollout engine, and all it asks: NativeEngine (above) and
    sglang_engine.SGLangEngine implement it; `ENGINES` names the builders, `build_engine` calls one.

    generate(prompts, params, *, n, seed, group_ids): n Rollouts of each prompt (token ids),
        prompt-major, each sample's random stream keyed by (seed, group id, sample index): batching
        does not change what is sampled. A Rollout records tokens, logprobs, routes, weight version, and its
        text (the run's tokenizer's decode of its ids: what the verifiers and scorers read).
    update_weights(named_tensors, version): take the trainer's weights (weights.policy_tensors names)
        and stamp `version` (RL steps trained, the weight_version) on what it generates from then on.
    phase(): around a step's (or an eval's) generate calls: gathering weights or switching process
        groups happens once per phase. sleep() / wake(): release and take back the engine's memory
        around the trainer's update. memory(): {name: bytes} this rank holds for it (logged as
        engine/<name>_bytes). counters(): {name: count} of what it counted in this phase (logged as
        engine/<name>: NativeEngine's preemptions, SGLang's sampled ids past the tokenizer).
    weight_version: the version stamped on what it generates now (the async loop reads it).
    """
    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]: ...

    def update_weights(self, named_tensors: Named, version: int) -> None: ...

    def phase(self) -> AbstractContextManager: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def memory(self) -> dict[str, int]: ...

    def counters(self) -> dict[str, int]: ...


def build_native_engine(cfg: TrainConfig, tok: Tokenizer, policy: nn.Module) -> NativeEngine:
    """The native engine of a run: under torchrun on the sharded policy itself (no replica), in one process
    a copy of the policy's weights (FP8 with engine.fp8), filled by the first update_weights; engine.slots > 0
    batches continuously."""
    on_policy = policy if rank_world()[1] > 1 else None
    return NativeEngine(cfg.model, Vocab(tok.stop_ids, tok.pad_id, num_tokens=tok.enc.n_vocab, decode=tok.decode),
                        device=cfg.device, dtype=cfg.compute_dtype(), compile=cfg.compile, policy=on_policy,
                        options=cfg.engine)


ENGINES: dict[str, Callable[[TrainConfig, Tokenizer, nn.Module], Engine]] = {
    "native": build_native_engine,
    "sglang": build_sglang_engine,
}
"""The rollout engines a run can use (engine.name): name -> builder(cfg, tok, policy). A new engine is a
file implementing `Engine` and one line here."""


JUDGE_SEED = 0  # a generative judge decodes greedily; a fixed seed keeps its calls off torch's RNG (the policy's)


def judge_generator(cfg: TrainConfig):
    """How a generative judge (reward.model=judge:<folder>) of a run of cfg (config.TrainConfig) generates:
    builder(model, tok) -> a greedy generator on a NativeEngine of its own holding the judge's weights (cfg.device,
    the run's compute dtype), replies of at most reward.judge_max_new_tokens, their stop token left out. Under
    torchrun each rank holds a whole judge, which judges the groups that rank generated (shaping.shape_rewards)."""
    def build(model, tok):
        engine = NativeEngine(model.cfg, Vocab(tok.stop_ids, tok.pad_id, num_tokens=tok.enc.n_vocab),
                              device=cfg.device, dtype=cfg.compute_dtype())
        engine.update_weights(policy_tensors(model), version=0)
        params = SamplingParams(max_new_tokens=cfg.reward.judge_max_new_tokens, temperature=0.0)

        def generate(prompts: list[list[int]]) -> list[list[int]]:
            replies = engine.generate(prompts, params, seed=JUDGE_SEED)
            return [r.text_ids for r in replies]
        return generate
    return build


def stop_engine_servers():
    """Stop the engine servers this process launched (a colocated SGLang's): what the abort path of a failed job calls."""
    stop_launched_servers()


def engine_builder(name: str) -> Callable[[TrainConfig, Tokenizer, nn.Module], Engine]:
    """The builder of engine `name`. Raises ValueError naming engine.name and the valid names."""
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r}: need one of {', '.join(map(repr, ENGINES))} (rollout.ENGINES)")
    return ENGINES[name]


def build_engine(cfg: TrainConfig, tok: Tokenizer, policy: nn.Module) -> Engine:
    """The run's rollout engine, engine.name's builder called on the policy (trainer's model); with tools.enabled
    wrapped in a ToolEngine (tool_rollout.py), whose rows call the tools between turns."""
    engine = engine_builder(cfg.engine.name)(cfg, tok, policy)
    if not cfg.tools.enabled:
        return engine
    return ToolEngine(engine, tok, cfg.tools, model_type=cfg.model.hf_model_type, max_seq_len=cfg.model.max_seq_len)


def producer_engine(engine: Engine, cfg: TrainConfig, policy: nn.Module) -> Engine:
    """The async producer's engine beside the trainer's: a copy of a one-process native engine, or under
    torchrun one on a sharded copy of the policy over process groups of its own (its collectives never
    share a communicator with the trainer's). A ToolEngine's producer is one over its inner engine's. Raises
    ValueError for another engine than the native one."""
    if isinstance(engine, ToolEngine):
        return ToolEngine(producer_engine(engine.inner, cfg, policy), engine.tok, engine.cfg,
                          model_type=cfg.model.hf_model_type, max_seq_len=engine.max_seq_len)
    if not isinstance(engine, NativeEngine):
        raise ValueError(f"max_staleness={cfg.max_staleness}: async rollouts run on the native engine only")
    if not engine.sharded:  # its own copy of the weights; the tokenizer's decode shared, not copied
        return copy.deepcopy(engine, memo={id(engine.vocab): engine.vocab})
    meshes = own_meshes(rank_world()[1], cfg.ep)
    set_group_timeouts(cfg.dist_timeout_s)  # the new groups too
    producer = NativeEngine(cfg.model, engine.vocab, device=cfg.device, dtype=cfg.compute_dtype(), compile=cfg.compile,
                            policy=reference_copy(policy, cfg, meshes), group=meshes.fsdp.get_group(),
                            options=engine.options)
    producer.weight_version = engine.weight_version  # the version its copy holds (a resumed run's, say)
    return producer
