"""Rollout engines: the interface an RL step uses, their registry, and the native engine.

This file owns the rollout side of an RL step: `Engine` (the protocol both engines implement:
generate, update_weights, phase, sleep, wake, memory, weight_version), `ENGINES` (name ->
builder, what engine.name picks) with `build_engine` and the async producer's `producer_engine`,
and `NativeEngine` (prefill and decode over a static KV cache in plain PyTorch, CPU or GPU, on its
own copy of the weights or on the sharded policy itself), with its bucketed weight sync.
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
5. FP8 weights (`NativeEngine(fp8=True)`): blockwise e4m3 modules and the trainer-side
   quantiser, DeepSeek-V3's recipe, live in weights.py; a high-precision tensor sent for an
   FP8 weight is quantised on arrival.
6. Weight sync in buckets of at most DEFAULT_BUCKET_BYTES (`weight_buckets`), each staged as one
   flat copy per dtype (`_stage`): staging memory stays bounded and a sync is a few large
   transfers, not one per tensor.
7. Continuous batching, off by default (engine.slots, `NativeEngine(slots=N)`, `ContinuousBatch`): at
   most N rows decode at once, each slot at its own cache column (`KVCache.update_rows`), and a stopped
   row's slot takes the next row of the call, its prompt's prefill copied in. The same sampling
   streams, so the same tokens and routes as one static call; a long-tailed call then runs its
   rows in far fewer decode row-steps than static calls of N rows (bench/continuous.py). On the
   sharded policy the ranks keep lockstep: one collective per admission round or decode step picks
   the same next forward on every rank (a rank with nothing to admit prefills a placeholder, one
   whose rows are done steps idle slots) until every rank's rows are done, and the decode steps run
   under `model.capacity_dispatch(model, slots)`: fixed-size all-to-alls, no host sync per MoE layer.
"""

from __future__ import annotations

import copy
from collections import deque
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch
import torch.nn as nn

from distributed import (all_ranks, all_reduce_float, collective_group, gathered, load_shards, own_meshes, rank_world,
                         reference_copy, set_group_timeouts)
from model import KVCache, ModelConfig, Transformer, capacity_dispatch, route_dtype
from sampler import _GOLDEN, Rollout, SamplingParams, row_keys, row_uniforms, sample
from sglang_engine import build_sglang_engine, stop_launched_servers
from weights import (DEFAULT_BUCKET_BYTES, FP8, FP8GroupedExperts, FP8Linear, Named, full_tensor, local,
                     quantize_fp8_blockwise, to_fp8_modules, weight_buckets)

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
        # (sum of numels,) flat; to a GPU engine the slots' copy_ is ordered after it on the same stream
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
    [0, col] (`model.single_query_attention`). Writes this token's keys and values at column
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
    slots: 0 (the default) decodes every row of a call in one static batch until the last one stops;
    N > 0 decodes at most N rows at once and refills a stopped row's slot (`ContinuousBatch`), on the
    sharded policy in lockstep with the other ranks. `batch_stats` then holds the last call's counts.
    """

    def __init__(self, cfg: ModelConfig, *, eos_id: int | Sequence[int], pad_id: int, device="cpu",
                 dtype=torch.float32, fp8: bool = False, compile: bool = False, num_tokens: int | None = None,
                 policy: nn.Module | None = None, group=None, slots: int = 0):
        # eos_id: one id or several (a chat model stops at <|im_end|> and at <|endoftext|>).
        # num_tokens: the tokenizer's ids, 0..num_tokens - 1; a checkpoint's embedding may have more rows (Qwen3:
        # 151,936 for 151,665 tokens), which are never sampled: no id the tokenizer cannot decode. Their
        # probability mass (nil in a trained model) is what the engine's logprobs then differ by from the trainer's.
        self.cfg, self.pad_id, self.num_tokens = cfg, pad_id, num_tokens
        self.stop_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        self.device, self.dtype, self.fp8, self.group = torch.device(device), dtype, fp8, group
        self.weight_version, self.sharded, self._phase = 0, policy is not None, None
        self.kv_bytes = 0  # the largest KV cache a generate call of this phase allocated (the run logs it)
        self._decode_step = torch.compile(decode_step, dynamic=True) if compile else decode_step
        # slots: 0 = one static batch per call (every row decodes until the last one stops); N > 0 = continuous
        # batching (`ContinuousBatch`): at most N rows decode at once and a stopped row's slot takes the next
        if slots < 0:
            raise ValueError(f"slots={slots}: need 0 (one static batch per call) or how many rows decode at once")
        self.slots = slots
        self.batch_stats: dict[str, int] = {}  # the last continuous call's counts (ContinuousBatch.stats)
        if policy is not None:  # no FP8 on the sharded policy (config.RELATIONS refuses engine.fp8 on several ranks)
            self.model = policy  # the trainer's own module: nothing to copy, nothing to sync
            return
        # no gradients, ever; the initial values are placeholders until the first update_weights
        self.model = Transformer(cfg).to(self.device, dtype).eval().requires_grad_(False)
        for block in self.model.layers:
            if block.is_moe:
                block.mlp.gate.float()  # the router's weight stays fp32 in any engine dtype, as in the trainer
        if fp8:  # after .to(dtype), which would otherwise cast the e4m3 buffers back to dtype
            to_fp8_modules(self.model, dtype)
        self.weight_version = 0
        named = list(self.model.named_parameters(remove_duplicate=False)) + list(self.model.named_buffers())
        self._slots = dict(named)  # every name a trainer may send, tied names included
        persistent = set(self.model.state_dict())  # non-persistent buffers (softmax router's expert_bias) need not come
        # what every sync must bring: each parameter once (tied ones under one name) and each persistent buffer
        self._required = {n for n, _ in list(self.model.named_parameters()) + list(self.model.named_buffers())
                          if n in persistent}
        self._fp8_weights = {n for n, t in self._slots.items() if t.dtype == FP8}  # quantise these on arrival

    @contextmanager
    def phase(self):
        """A rollout phase: on the sharded policy the weights stay gathered across every generate call
        inside it (a collective: every rank enters and leaves together), and this thread's collectives
        (distributed.py's) run on the engine's group. kv_bytes counts from its start, so what a step
        reports does not depend on what ran before it (a resumed run's too)."""
        if self._phase is not None:  # already inside one
            yield
            return
        self.kv_bytes = 0
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
        the gathered ones, which live only during a rollout phase) and its largest KV cache in this phase."""
        if self.sharded:
            with self.phase():
                weights = dict(self._phase)
        else:
            weights = weight_bytes(self.model)
        return {**weights, "kv_cache": self.kv_bytes}

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
        # slot's dtype before any transfer: a bf16 engine receives bf16 bytes
        named_tensors = ((n, self._as_slot(n, full_tensor(t))) for n, t in named_tensors)
        for bucket in weight_buckets(named_tensors, DEFAULT_BUCKET_BYTES):
            for name, t in _stage(bucket, self.device):
                slot = self._slots.get(name)
                if slot is None:
                    raise ValueError(f"update_weights: unknown tensor {name!r}")
                if slot.shape != t.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(slot.shape)}")
                if name in self._fp8_weights and t.dtype != FP8:
                    q, s = quantize_fp8_blockwise(t)  # the same blocks as quantize_fp8 on the trainer's side
                    self._slots[name + "_scale_inv"].copy_(s)
                    t = q
                    seen.add(name + "_scale_inv")
                slot.copy_(t)  # in place: the modules (and a compiled decode step) keep holding the same tensors
                seen.add(name)
        if missing := self._required - seen:
            raise ValueError(f"update_weights: missing {sorted(missing)[:5]} ({len(missing)} in all)")
        for module in self.model.modules():
            if isinstance(module, (FP8Linear, FP8GroupedExperts)):
                module.refresh()  # the cached dequantised weights follow the new values
        self.weight_version = version  # stamped on every Rollout generated from now on

    def _as_slot(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t in its slot's floating dtype (an FP8 slot takes high precision and quantises it on arrival)."""
        slot = self._slots.get(name)
        if slot is None or slot.dtype == FP8 or not t.is_floating_point() or t.dtype == FP8:
            return t
        return t.to(slot.dtype)

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
                if prompts:
                    return self._generate(prompts, params, n, seed, group_ids)
                self._generate([[self.pad_id]], params, 1, 0, None)  # joins the others' collectives; dropped
                return []
        return self._generate(prompts, params, n, seed, group_ids)

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
            batch = ContinuousBatch(self, prompts, n, params, keys_B)
            rollouts = batch.run(groups)
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

    def _prefill_prompts(self, uprompts: list[tuple]):
        """One forward over distinct prompts, left-padded to the longest (T) so each ends at column T - 1.
        Returns their KVCache [layers, U, J, T, d], last-token logits [U, V] fp32, routes [U, T, L, K]
        (int64) and left padding [U]."""
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
        prefill, last_UV, routes_UTLK, pad_U = self._prefill_prompts(uprompts)
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



# ----------------------------------------------------------------------------- continuous batching

IDLE = -1
"""slot_row of a slot holding no row: it keeps stepping with padding (no shape depends on data), its output dropped."""
DONE, STEP, ADMIT = 0, 1, 2
"""ContinuousBatch's next move, ordered so that the largest over ranks is the one every rank takes."""


def row_uniforms_at(keys_B: torch.Tensor, step_B: torch.Tensor) -> torch.Tensor:
    """`row_uniforms` with a draw index per row, step_B [B] int64: float64 [B] in [0, 1).

    splitmix64's counter is additive (draw t of key k hashes k + (t + 1) * golden, wrapping mod 2^64), so
    draw t of key k is draw 0 of key k + t * golden: the same bits as row_uniforms(keys, t) row by row.
    """
    return row_uniforms(keys_B + step_B * _GOLDEN, 0)  # int64 products and sums wrap, as the stream's own


def decode_rows(model: Transformer, tokens_B: torch.Tensor, cache: KVCache, routes_BSLK: torch.Tensor,
                col_B: torch.Tensor, bias_B11W: torch.Tensor) -> torch.Tensor:
    """`decode_step` with a cache column per row, col_B [B] int64: logits [B, V] fp32 after feeding tokens_B.

    Row b's token is written at column col_B[b] with RoPE position col_B[b] (a slot's columns start at its
    prompt's first token) and attends over columns [0, W) under bias_B11W (fp32, 0 on its columns <= col_B[b],
    -inf past them); its routed experts go to routes_BSLK[b, col_B[b]].
    """
    h_B1D, routes_B1LK = model.hidden(tokens_B[:, None], pos_BT=col_B[:, None], return_routes=True,
                                      cache=cache, cache_start=col_B, mask_B1TS=bias_B11W)
    # (B, L, K) int64 -> route_dtype, each row at its own column
    routes_BSLK[torch.arange(len(col_B), device=col_B.device), col_B] = routes_B1LK[:, 0].to(routes_BSLK.dtype)
    return model.lm_head(h_B1D[:, 0]).float()  # (B, V) fp32 for the sampler


@dataclass
class Prefilled:
    """A distinct prompt's prefill, kept from its first row's admission until its last row's."""
    cache: KVCache  # the admission round's prefill, [layers, U, J, T, d]; this prompt is row u, after `pad` columns
    u: int
    pad: int
    logits_V: torch.Tensor  # fp32: the first completion token's
    routes_TLK: torch.Tensor  # the prompt's routes (with the round's left padding first)
    rows_left: int  # rows of this prompt still in the queue


class ContinuousBatch:
    """One generate call of `NativeEngine(slots=...)`, continuous batching (Orca, OSDI 2022, iteration-level
    scheduling): the call's rows (prompt x sample, prompt-major) wait in a queue and at most `slots` decode at once,
    each in a slot of its own; when a row stops, its slot takes the next row in the queue, until it is empty.

    1. Prefill once per distinct prompt, when its first row is admitted (the prompts new in one admission
       round are prefilled together, left-padded as the static engine does); each admitted row copies its
       prompt's real columns into its slot and samples its first token from the prefill's logits.
    2. A slot's columns: its prompt's T tokens at [0, T), completion token t fed at column T + t with RoPE position
       T + t (the static engine's position for it). Each decode step writes every slot at its own column
       (`KVCache.update_rows`) and attends over [0, W), W - 1 the highest column a live row feeds, masked
       per slot past its own column.
    3. Sampling as the static engine's: draw t of row (seed, group, sample) for its t-th token, t the row's
       own step, so a row's tokens depend on its own stream only. Where every row of a call fits in a slot
       and the prompts are equally long, the steps run the static engine's shapes and give its rollouts
       bit for bit; otherwise attention reduces over a differently sized window and the matmuls see other
       batch-mates, so logprobs differ by float rounding.
    4. The host reads the stop flags after every step (one sync), so a freed slot waits no step; a stopped
       row's slot with nothing left to take keeps stepping on padding, its output dropped.
    5. On the sharded policy every forward is a collective (the experts' all-to-all), so the ranks run the same
       sequence of forwards: before each admission round or decode step one all-reduce takes the largest of
       the ranks' next moves (ADMIT while any rank has a free slot and a queued row, else STEP while any has a
       live row, else DONE). A rank with nothing to admit prefills a one-token placeholder; a rank whose rows
       are done steps its idle slots on padding, as the static engine's placeholder row does. The decode
       steps run under `capacity_dispatch(model, slots)`, the same bound on every rank (a rank's batch has at
       most `slots` rows), so no MoE layer waits for the host; a prefill (many tokens) keeps the dispatcher.
    The decode step runs eagerly (the engine's compile option is for the static step).

    Letters beside the legend's: B is a slot (a row of the decode batch), X the call's rollouts (its rows,
    prompt x sample, prompt-major), W the cache columns a step attends, A the rows an admission round takes in.
    """

    def __init__(self, engine: NativeEngine, prompts: list[list[int]], n: int, params: SamplingParams,
                 keys_X: torch.Tensor):
        cfg, dev, C = engine.cfg, engine.device, params.max_new_tokens
        self.engine, self.prompts, self.n, self.params, self.keys_X = engine, prompts, n, params, keys_X
        X = len(prompts) * n
        B = self.num_slots = min(engine.slots, X)  # more slots than rows would only step padding
        S = max(len(p) for p in prompts) + C - 1  # the last sampled token is never fed back
        self.cache = KVCache(cfg, B, S, dtype=engine.dtype, device=dev)  # (n_layers, B, J, S, d)
        engine.kv_bytes = max(engine.kv_bytes, 2 * self.cache.k.numel() * self.cache.k.element_size())
        # the Rollout's dtype (route_dtype); a slot's columns past its row's last fed token are never read
        self.routes_BSLK = torch.empty(B, S, cfg.num_moe_layers, cfg.top_k, dtype=route_dtype(cfg.num_experts),
                                       device=dev)
        # (X + 1, C): rollout X is where idle slots write, so a step's writes need no host-side selection
        self.ids_XC = torch.full((X + 1, C), engine.pad_id, dtype=torch.long, device=dev)
        self.logp_XC = torch.zeros(X + 1, C, device=dev)
        self.stops = torch.tensor(engine.stop_ids, dtype=torch.long, device=dev)
        self.queue = deque(range(X))  # the rollouts (rows) not yet admitted, in row order
        self.slot_row, self.slot_step, self.slot_col = [IDLE] * B, [0] * B, [0] * B  # step: tokens sampled so far
        self.last_B = torch.full((B,), engine.pad_id, dtype=torch.long, device=dev)  # what each slot feeds next
        self.keys_B = torch.zeros(B, dtype=torch.long, device=dev)  # the stream key of each slot's row
        self.length, self.stopped, self.routes = [0] * X, [False] * X, [None] * X
        rows_of: dict[tuple, int] = {}
        for p in prompts:
            rows_of[tuple(p)] = rows_of.get(tuple(p), 0) + n  # a repeated prompt shares one prefill
        self.rows_of, self.prefilled = rows_of, {}
        # rounds: admission rounds, each one prefill forward (a placeholder's on a sharded rank with no new prompt)
        self.stats = {"rows": X, "slots": B, "admissions": 0, "prefills": 0, "rounds": 0, "decode_steps": 0,
                      "decode_row_steps": 0, "useful_row_steps": 0}

    def run(self, groups: list[int]) -> list[Rollout]:
        """Admit, step and refill until every row has stopped (on the sharded policy, every rank's); the
        Rollouts in row order (prompt-major)."""
        while (move := self.next_move()) != DONE:
            if move == ADMIT:
                self.admit()
            else:
                self.step()
        engine, n = self.engine, self.n
        ids, logp_XC = self.ids_XC.tolist(), self.logp_XC.float().cpu()  # one device-to-host copy each
        return [Rollout(prompt_ids=list(self.prompts[r // n]), completion_ids=ids[r][:c],
                        logprobs=logp_XC[r, :c].clone(), routes=self.routes[r].cpu(), finish_reason="stop" if self.stopped[r] else "length",
                        group_id=groups[r // n], weight_version=engine.weight_version)
                for r, c in enumerate(self.length)]

    def next_move(self) -> int:
        """ADMIT while a free slot can take a queued row (a row stopping at its first token frees its slot at
        once: another round), else STEP while a row is live, else DONE; on the sharded policy the largest
        of every rank's (choice 5: one collective)."""
        if self.queue and IDLE in self.slot_row:
            move = ADMIT
        else:
            move = STEP if any(r != IDLE for r in self.slot_row) else DONE
        if self.engine.sharded:
            move = int(all_reduce_float(float(move), "max"))
        return move

    def admit(self):
        """One admission round: fill the free slots from the queue, copy each row's prompt prefill in and
        sample its first token. On the sharded policy a rank with no row to admit only joins the prefill."""
        dev = self.engine.device
        free = [s for s, r in enumerate(self.slot_row) if r == IDLE]
        rows = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        slots = free[:len(rows)]
        self.prefill([tuple(self.prompts[r // self.n]) for r in rows])
        if not rows:
            return
        logits = []
        for s, r in zip(slots, rows):
            p = tuple(self.prompts[r // self.n])
            pre, T = self.prefilled[p], len(p)
            # (n_layers, J, T, d): the prompt's real columns, its round's left padding dropped
            self.cache.k[:, s, :, :T] = pre.cache.k[:, pre.u, :, pre.pad:]
            self.cache.v[:, s, :, :T] = pre.cache.v[:, pre.u, :, pre.pad:]
            self.routes_BSLK[s, :T] = pre.routes_TLK[pre.pad:]  # (T, L, K)
            logits.append(pre.logits_V)
            pre.rows_left -= 1
            if not pre.rows_left:
                del self.prefilled[p]  # its last row is in: the round's cache goes with its last prompt
            self.slot_row[s], self.slot_step[s], self.slot_col[s] = r, 1, T  # token 0 is fed at column T
        rows_A, slots_A = torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        self.keys_B[slots_A] = self.keys_X[rows_A]
        ids_A, logp_A = sample(self.vocab(torch.stack(logits)), self.params, row_uniforms(self.keys_X[rows_A], 0))
        self.ids_XC[rows_A, 0], self.logp_XC[rows_A, 0], self.last_B[slots_A] = ids_A, logp_A, ids_A
        self.stats["admissions"] += len(rows)
        for s, stop in zip(slots, torch.isin(ids_A, self.stops).tolist()):
            if stop or self.params.max_new_tokens == 1:
                self.finish(s, stop)

    def prefill(self, prompts: list[tuple]):
        """Prefill, in one forward, the distinct prompts among these that have none yet. On the sharded policy
        the forward runs even when there are none (a one-token placeholder, dropped): every rank's round has one."""
        new = list(dict.fromkeys(p for p in prompts if p not in self.prefilled))  # first-seen order
        if not new and not self.engine.sharded:
            return
        self.stats["rounds"] += 1
        if not new:  # joins the other ranks' prefill forward (its all-to-alls)
            self.engine._prefill_prompts([(self.engine.pad_id,)])
            return
        cache, logits_UV, routes_UTLK, pad_U = self.engine._prefill_prompts(new)
        for u, (p, pad) in enumerate(zip(new, pad_U.tolist())):
            self.prefilled[p] = Prefilled(cache, u, pad, logits_UV[u], routes_UTLK[u], self.rows_of[p])
        self.stats["prefills"] += len(new)

    def step(self):
        """One decode step of every slot, then sample each live row's next token and retire stopped rows."""
        engine, dev, B = self.engine, self.engine.device, self.num_slots
        live = [r != IDLE for r in self.slot_row]
        # the columns any live row attends (a sharded rank whose rows are all done steps with idle slots only)
        W = max((c for c, on in zip(self.slot_col, live) if on), default=0) + 1
        # an idle slot steps at its next column, as a stopped row of the static engine does, kept inside [0, W)
        col_B = torch.tensor([c if on else min(c, W - 1) for c, on in zip(self.slot_col, live)], device=dev)
        # (B, 1, 1, W), broadcast over heads: each slot attends its own columns only
        bias_B11W = torch.zeros(B, 1, 1, W, device=dev).masked_fill_(
            (torch.arange(W, device=dev)[None] > col_B[:, None])[:, None, None], float("-inf"))
        # sharded: fixed-size all-to-alls bounded by `slots` on every rank (choice 5), no host sync per MoE layer
        with capacity_dispatch(engine.model, engine.slots) if engine.sharded else nullcontext():
            logits_BV = decode_rows(engine.model, self.last_B, self.cache, self.routes_BSLK, col_B, bias_B11W)
        step_B = torch.tensor([t if on else 0 for t, on in zip(self.slot_step, live)], device=dev)
        ids_B, logp_B = sample(self.vocab(logits_BV), self.params, row_uniforms_at(self.keys_B, step_B))
        ids_B = ids_B.masked_fill_(~torch.tensor(live, device=dev), engine.pad_id)  # idle slots feed padding
        row_B = torch.tensor([r if on else len(self.length) for r, on in zip(self.slot_row, live)], device=dev)
        self.ids_XC[row_B, step_B], self.logp_XC[row_B, step_B], self.last_B = ids_B, logp_B, ids_B
        self.stats["decode_steps"] += 1
        self.stats["decode_row_steps"] += B
        self.stats["useful_row_steps"] += sum(live)
        stop_B = torch.isin(ids_B, self.stops).tolist()  # the host sync of a step: which rows stopped
        for s in range(B):
            self.slot_col[s] += 1
            if live[s]:
                self.slot_step[s] += 1
                if stop_B[s] or self.slot_step[s] == self.params.max_new_tokens:
                    self.finish(s, stop_B[s])

    def finish(self, s: int, stop: bool):
        """Retire slot s's row: record its length and routes [T + C - 1, L, K] (the tokens it fed) and free the slot."""
        r, c = self.slot_row[s], self.slot_step[s]
        T = len(self.prompts[r // self.n])
        self.length[r], self.stopped[r] = c, stop
        self.routes[r] = self.routes_BSLK[s, :T + c - 1].clone()  # before the slot's next row overwrites them
        self.slot_row[s] = IDLE

    def vocab(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """The logits with the vocabulary's padding rows (ids the tokenizer cannot decode) at -inf."""
        num_tokens = self.engine.num_tokens
        if num_tokens is not None and num_tokens < logits_BV.shape[1]:
            logits_BV[:, num_tokens:] = float("-inf")
        return logits_BV


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
        does not change what is sampled. A Rollout records tokens, logprobs, routes, weight version.
    update_weights(named_tensors, version): take the trainer's weights (weights.policy_tensors names)
        and stamp `version` (RL steps trained, the weight_version) on what it generates from then on.
    phase(): around a step's (or an eval's) generate calls: gathering weights or switching process
        groups happens once per phase. sleep() / wake(): release and take back the engine's memory
        around the trainer's update. memory(): {name: bytes} this rank holds for it (logged).
    """
    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, seed: int | None = None,
                 group_ids: list[int] | None = None) -> list[Rollout]: ...

    def update_weights(self, named_tensors: Named, version: int) -> None: ...

    def phase(self) -> AbstractContextManager: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def memory(self) -> dict[str, int]: ...


def build_native_engine(cfg: TrainConfig, tok: Tokenizer, policy: nn.Module) -> NativeEngine:
    """The native engine of a run: under torchrun on the sharded policy itself (no replica), in one process
    a copy of the policy's weights (FP8 with engine.fp8), filled by the first update_weights; engine.slots > 0
    batches continuously."""
    on_policy = policy if rank_world()[1] > 1 else None
    return NativeEngine(cfg.model, eos_id=tok.stop_ids, pad_id=tok.pad_id, device=cfg.device, dtype=cfg.compute_dtype(),
                        compile=cfg.compile, num_tokens=tok.enc.n_vocab, fp8=cfg.engine.fp8, policy=on_policy,
                        slots=cfg.engine.slots)


ENGINES: dict[str, Callable[[TrainConfig, Tokenizer, nn.Module], Engine]] = {
    "native": build_native_engine,
    "sglang": build_sglang_engine,
}
"""The rollout engines a run can use (engine.name): name -> builder(cfg, tok, policy). A new engine is a
file implementing `Engine` and one line here."""


def stop_engine_servers():
    """Stop the engine servers this process launched (a colocated SGLang's): what the abort path of a failed job calls."""
    stop_launched_servers()


def engine_builder(name: str) -> Callable[[TrainConfig, Tokenizer, nn.Module], Engine]:
    """The builder of engine `name`. Raises ValueError naming engine.name and the valid names."""
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r}: need one of {', '.join(map(repr, ENGINES))} (rollout.ENGINES)")
    return ENGINES[name]


def build_engine(cfg: TrainConfig, tok: Tokenizer, policy: nn.Module) -> Engine:
    """The run's rollout engine, engine.name's builder called on the policy (trainer's model)."""
    return engine_builder(cfg.engine.name)(cfg, tok, policy)


def producer_engine(engine: Engine, cfg: TrainConfig, policy: nn.Module) -> Engine:
    """The async producer's engine beside the trainer's: a copy of a one-process native engine, or under
    torchrun one on a sharded copy of the policy over process groups of its own (its collectives never
    share a communicator with the trainer's). Raises ValueError for another engine than the native one."""
    if not isinstance(engine, NativeEngine):
        raise ValueError(f"max_staleness={cfg.max_staleness}: async rollouts run on the native engine only")
    if not engine.sharded:
        return copy.deepcopy(engine)
    meshes = own_meshes(rank_world()[1], cfg.ep)
    set_group_timeouts(cfg.dist_timeout_s)  # the new groups too
    producer = NativeEngine(cfg.model, eos_id=engine.stop_ids, pad_id=engine.pad_id, device=cfg.device,
                            dtype=cfg.compute_dtype(), compile=cfg.compile, num_tokens=engine.num_tokens,
                            policy=reference_copy(policy, cfg, meshes), group=meshes.fsdp.get_group(),
                            slots=engine.slots)
    producer.weight_version = engine.weight_version  # the version its copy holds (a resumed run's, say)
    return producer
