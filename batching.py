"""Continuous batching for NativeEngine (`NativeEngine(slots=N)`, engine.slots; rollout.py's choice 7):
`ContinuousBatch`, one generate call whose rows queue into a fixed number of slots, each decoding at its
own cache column (`decode_rows`), a stopped row's slot taken by the next. Shapes as in rollout.py.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from distributed import all_reduce_float
from ep_decode import capacity_dispatch
from model import KVCache, Transformer, route_dtype
from sampler import Rollout, SamplingParams, row_uniforms, row_uniforms_at, sample

IDLE = -1
"""slot_row of a slot holding no row: it keeps stepping with padding (no shape depends on data), its output dropped."""
DONE, STEP, ADMIT = 0, 1, 2
"""ContinuousBatch's next move, ordered so that the largest over ranks is the one every rank takes."""


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
    engine: the rollout.NativeEngine whose call this is (its model, cfg, device, dtype, slots, stop ids).
    """

    def __init__(self, engine, prompts: list[list[int]], n: int, params: SamplingParams,
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


