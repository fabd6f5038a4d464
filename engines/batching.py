"""Continuous batching for NativeEngine (engine.slots; rollout.py's choice 7):
`ContinuousBatch`, one generate call whose rows queue into a fixed number of slots, each decoding at its
own cache column (`decode_rows`), a stopped row's slot taken by the next. What a call uses of its engine is
named (`EngineParts`: the model, the engine options, a `Prefill` callable, the token ids), and what it counts
for the engine (KV bytes, preemptions) it keeps on itself for the engine to read back. Shapes as in rollout.py.
"""

from __future__ import annotations

from collections import Counter, deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from distributed import all_reduce_float
from engines.ep_decode import capacity_dispatch
from engines.graph_decode import make_decode_step
from model import KVCache, Transformer, route_dtype
from paged_kv import PagedKVCache, least_pages, pages_for, pool_pages, too_few_pages
from sampler import Rollout, SamplingParams, row_uniforms, row_uniforms_at, sample

if TYPE_CHECKING:
    from config import EngineConfig

IDLE = -1
"""slot_row of a slot holding no row: it keeps stepping with padding (no shape depends on data), its output dropped."""
DONE, STEP, ADMIT, STALLED = 0, 1, 2, 3
"""ContinuousBatch's next move, ordered so that the largest over ranks is the one every rank takes: STALLED (a rank
made no progress, choice 8) stops every rank together."""


def decode_rows(model: Transformer, tokens_B: torch.Tensor, cache: KVCache | PagedKVCache, routes_BSLK: torch.Tensor,
                col_B: torch.Tensor, bias_B11W: torch.Tensor) -> torch.Tensor:
    """rollout.decode_step with a cache column per row, col_B [B] int64: logits [B, V] fp32 after feeding tokens_B.

    Row b's token is written at column col_B[b] with RoPE position col_B[b] (a slot's columns start at its
    prompt's first token) and attends over columns [0, W) under bias_B11W (fp32, 0 on its columns <= col_B[b],
    -inf past them); its routed experts go to routes_BSLK[b, col_B[b]].
    """
    h_B1D, routes_B1LK = model.hidden(tokens_B[:, None], pos_BT=col_B[:, None], return_routes=True,
                                      cache=cache, cache_start=col_B, mask_B1TS=bias_B11W)
    # (B, L, K) int64 -> route_dtype, each row at its own column
    routes_BSLK[torch.arange(len(col_B), device=col_B.device), col_B] = routes_B1LK[:, 0].to(routes_BSLK.dtype)
    return model.lm_head(h_B1D[:, 0]).float()  # (B, V) fp32 for the sampler


Prefill = Callable[[list[tuple[int, ...]]], tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor]]
"""One forward over U distinct prompts, left-padded to the longest (T) so each ends at column T - 1: their KVCache
[layers, U, J, T, d], last-token logits [U, V] fp32, routes [U, T, L, K] int64 and left padding [U] int64
(rollout.NativeEngine.prefill_prompts)."""


@dataclass(frozen=True)
class EngineParts:
    """What a continuous call uses of the engine whose call it is (rollout.NativeEngine fills it from its own
    fields), and all it uses."""
    model: Transformer  # the engine's replica, or the sharded policy; model.cfg gives the cache's shapes
    options: EngineConfig  # slots, page_size, kv_tokens, prefill_tokens, cuda_graph
    prefill: Prefill  # the engine's prefill forward (choice 1)
    device: torch.device  # where the cache, the routes and the sampled ids live
    dtype: torch.dtype  # the KV cache's
    pad_id: int  # what an idle slot feeds, and the ids past a row's last token
    stop_ids: tuple[int, ...]  # a row stops at its first of these
    num_tokens: int | None  # the tokenizer's ids 0..num_tokens - 1; logits past them are never sampled
    sharded: bool  # on the sharded policy: every forward a collective, the ranks in lockstep (choice 5)


@dataclass
class Prefilled:
    """A distinct prompt's prefill, kept from its first row's admission until its last row's."""
    pages: list[int]  # its T columns of keys and values (paged_kv: the prompt's own hold on them)
    logits_V: torch.Tensor  # fp32: the first completion token's
    routes_TLK: torch.Tensor  # the prompt's routes


class ContinuousBatch:
    """One generate call of a NativeEngine with slots, continuous batching (Orca, OSDI 2022, iteration-level
    scheduling) over a paged KV cache (paged_kv.PagedKVCache): the call's rows (prompt x sample, prompt-major)
    wait in a queue and at most `slots` decode at once, each in a slot of its own; when a row stops, its slot
    and its pages take the next row in the queue, until it is empty.

    1. Prefill once per distinct prompt, when its first row is admitted (the prompts new in one admission
       round are prefilled together, left-padded as the static engine does, and written into pages at once);
       each admitted row shares its prompt's full pages, copies the partial last one (paged_kv's choice 3) and
       samples its first token from the prefill's logits.
    2. A slot's columns: its prompt's T tokens at [0, T), completion token t fed at column T + t with RoPE position
       T + t (the static engine's position for it). Each decode step writes every slot at its own column
       (`PagedKVCache.update_rows`) and attends over [0, W), W - 1 the highest column a live row feeds, masked
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
    6. Pages (engine.kv_tokens // engine.page_size of them; by default enough for every slot at full length
       beside one prompt's, so nothing is ever preempted): a row is admitted only when the pages it needs at
       once are free (its prompt's, if not prefilled yet, and its own copy of the last one) beside those the oldest
       live row may still take up to its full length (else it would soon be preempted for them), and takes one more
       each time it crosses into a new page, the rows in order of admission, oldest first. A row that finds no
       page free takes one from a younger row, never from an older one (vLLM's recompute preemption, the victim
       the youngest): the youngest live row younger than itself is preempted (its pages return, it goes back to
       the head of the queue and is generated again from its first token); with none, the prompts held for
       queued rows give their pages back (prefilled again when their rows come up); with none of those either,
       the row preempts itself. Its tokens come from its own stream (choice 3), so the redo samples them again,
       up to the float rounding of other batch-mates.
       Invariant: the oldest live row is never preempted and always gets its page. Every other live row is
       younger, so it can take all their pages and the held prompts'; it then holds only its own row's pages,
       at most pages_for(T + C - 1) at full length, fewer than the least pool (paged_kv.least_pages:
       pages_for(T + C - 1) + pages_for(T), refused below it before any step). So the oldest row gains a token
       every decode step and stops within C - 1 of them; new rows are admitted younger and a preempted one
       comes back younger, so it stays the oldest until it stops. Nor can admission stall: with no row live the
       held prompts are given back, and one row (pages_for(T) + 1 pages at most) fits the least pool. So while
       rows are left, one stops at least every C - 1 decode steps, and the call ends within X * (C - 1) of them. (Preempting
       "the youngest other row" instead lets a younger row take an older one's pages: two rows that hold the
       pool preempt each other in turn, each restarting from its first token, and the call never ends.)
    7. An admission round prefills new prompts of engine.prefill_tokens tokens at most, left padding counted
       (one prompt whatever its length), which bounds its activations; the rows it leaves out are admitted by the
       next round, before the next decode step (slots stay free no longer than the prefills take).
    8. A progress guard: a rank with rows left counts the decode steps since one of its rows last stopped; C of
       them (more than a row needs, choice 6) can only mean a pool below the least (a caller's bypass of the
       check, or a bug), and the call raises a RuntimeError naming the engine settings and its counts rather
       than spin. So does a queue whose next row cannot fit an empty pool. On the sharded policy the rank says
       STALLED in the move's all-reduce (choice 5), so every rank raises at the same step.
    The decode step runs eagerly, or with engine.cuda_graph replays a CUDA graph captured at the call's first step
    (graph_decode.GraphedDecode: it attends all S columns every step; needs CUDA and bf16, and has not run on a
    GPU). The engine's compile option is for the static step.

    Letters beside the legend's: B is a slot (a row of the decode batch), X the call's rollouts (its rows,
    prompt x sample, prompt-major), W the cache columns a step attends, A the rows an admission round takes in.
    engine: what the call uses of its engine (`EngineParts`). What the call counts for the engine to read back:
    `kv_bytes` (its cache's bytes, keys and values), `kv_live_bytes` (the most of its pages held at once, in
    bytes) and stats["preemptions"], with the rest of `stats`.
    """

    def __init__(self, engine: EngineParts, prompts: list[list[int]], n: int, params: SamplingParams,
                 keys_X: torch.Tensor):
        cfg, dev, C = engine.model.cfg, engine.device, params.max_new_tokens
        self.engine, self.prompts, self.n, self.params, self.keys_X = engine, prompts, n, params, keys_X
        X = len(prompts) * n
        options = engine.options
        B = self.num_slots = min(options.slots, X)  # more slots than rows would only step padding
        T = max(len(p) for p in prompts)
        S = T + C - 1  # the last sampled token is never fed back
        p = self.page_size = options.page_size
        pages = pool_pages(B, T, C, p, options.kv_tokens)
        if options.kv_tokens and (why := too_few_pages(options.kv_tokens, T, C, p)):
            raise ValueError(why)
        self.cache = PagedKVCache(cfg, B, pages, p, S, dtype=engine.dtype, device=dev)  # (L, pages + 1, J, p, d)
        self.kv_bytes = 2 * self.cache.k.numel() * self.cache.k.element_size()
        self.kv_live_bytes = 0  # the most of the pool the rows (and held prompts) held at once, in bytes
        # the Rollout's dtype (route_dtype); a slot's columns past its row's last fed token are never read
        self.routes_BSLK = torch.empty(B, S, cfg.num_moe_layers, cfg.top_k, dtype=route_dtype(cfg.num_experts),
                                       device=dev)
        # the decode step: decode_rows eagerly, or captured in a CUDA graph at its first call (engine.cuda_graph)
        self.decode = make_decode_step(decode_rows, engine.model, self.cache, self.routes_BSLK,
                                  cuda_graph=options.cuda_graph)
        # (X + 1, C): rollout X is where idle slots write, so a step's writes need no host-side selection
        self.ids_XC = torch.full((X + 1, C), engine.pad_id, dtype=torch.long, device=dev)
        self.logp_XC = torch.zeros(X + 1, C, device=dev)
        self.stops = torch.tensor(engine.stop_ids, dtype=torch.long, device=dev)
        self.queue = deque(range(X))  # the rollouts (rows) not yet admitted, in row order
        self.slot_row, self.slot_step, self.slot_col = [IDLE] * B, [0] * B, [0] * B  # step: tokens sampled so far
        self.slot_age = [0] * B  # when the slot's row was admitted: a row takes pages from younger ones only (choice 6)
        self.last_B = torch.full((B,), engine.pad_id, dtype=torch.long, device=dev)  # what each slot feeds next
        self.keys_B = torch.zeros(B, dtype=torch.long, device=dev)  # the stream key of each slot's row
        self.length, self.stopped, self.routes = [0] * X, [False] * X, [None] * X
        self.queued = Counter(tuple(prompts[r // n]) for r in self.queue)  # a repeated prompt shares one prefill
        self.prefilled: dict[tuple, Prefilled] = {}
        # rounds: admission rounds, each one prefill forward (a placeholder's on a sharded rank with no new prompt)
        self.stats = {"rows": X, "slots": B, "admissions": 0, "prefills": 0, "rounds": 0, "decode_steps": 0,
                      "decode_row_steps": 0, "useful_row_steps": 0, "pages": pages, "page_size": p,
                      "peak_pages": 0, "preemptions": 0}
        self.stalled_steps = 0  # decode steps, with rows left, since a row last stopped (choice 8)

    def run(self, groups: list[int], weight_version: int) -> list[Rollout]:
        """Admit, step and refill until every row has stopped (on the sharded policy, every rank's); the
        Rollouts in row order (prompt-major), prompt i's group id groups[i], each stamped weight_version."""
        while (move := self.next_move()) != DONE:
            if move == STALLED:
                raise RuntimeError(self.stalled())
            if move == ADMIT:
                self.admit()
            else:
                self.step()
        n = self.n
        ids, logp_XC = self.ids_XC.tolist(), self.logp_XC.float().cpu()  # one device-to-host copy each
        return [Rollout(prompt_ids=list(self.prompts[r // n]), completion_ids=ids[r][:c],
                        logprobs=logp_XC[r, :c].clone(), routes=self.routes[r].cpu(), finish_reason="stop" if self.stopped[r] else "length",
                        group_id=groups[r // n], weight_version=weight_version)
                for r, c in enumerate(self.length)]

    def next_move(self) -> int:
        """ADMIT while a free slot can take the queue's next row (a row stopping at its first token frees its slot
        at once: another round), else STEP while a row is live, else DONE; STALLED before any of them when this
        rank made no progress (choice 8). On the sharded policy the largest of every rank's (choice 5: one
        collective)."""
        live = any(r != IDLE for r in self.slot_row)
        if self.queue and not live and not self.fits(self.queue[0]):
            self.give_back_prompts()  # nothing live will free a page: the held prompts' go (choice 6)
        if self.no_progress():
            move = STALLED
        elif self.queue and IDLE in self.slot_row and self.fits(self.queue[0]):
            move = ADMIT
        else:
            move = STEP if live else DONE
        if self.engine.sharded:
            move = int(all_reduce_float(float(move), "max"))
        self.stats["peak_pages"] = self.cache.peak
        page_bytes = 2 * self.cache.k[:, 0].numel() * self.cache.k.element_size()  # k and v, every layer
        self.kv_live_bytes = max(self.kv_live_bytes, self.cache.peak * page_bytes)
        return move

    def pages_needed(self, r: int, new: set) -> int:
        """Pages row r takes at admission: its prompt's, unless prefilled (or in `new`, this round's), and its
        own copy of the prompt's partial last page (paged_kv's choice 3)."""
        p = tuple(self.prompts[r // self.n])
        shared = 0 if p in self.prefilled or p in new else pages_for(len(p), self.page_size)
        return shared + (len(p) % self.page_size > 0)

    def fits(self, r: int) -> bool:
        return self.pages_needed(r, set()) <= len(self.cache.free) - self.kept_for_oldest()

    def kept_for_oldest(self) -> int:
        """Free pages admission leaves alone: those the oldest live row may still take, up to its full length
        (choice 6), so that a row is not admitted only to be preempted for them; none with no row live."""
        live = [s for s, r in enumerate(self.slot_row) if r != IDLE]
        if not live:
            return 0
        o = min(live, key=self.slot_age.__getitem__)
        full = pages_for(len(self.prompts[self.slot_row[o] // self.n]) + self.params.max_new_tokens - 1, self.page_size)
        return full - len(self.cache.tables[o])

    def admit(self):
        """One admission round: fill the free slots from the queue while pages last, attach each row to its
        prompt's pages and sample its first token. On the sharded policy a rank with no row to admit only joins
        the prefill."""
        dev = self.engine.device
        free = [s for s, r in enumerate(self.slot_row) if r == IDLE]
        rows, new, pages, longest = [], set(), len(self.cache.free) - self.kept_for_oldest(), 0
        while self.queue and len(rows) < len(free) and (need := self.pages_needed(self.queue[0], new)) <= pages:
            p = tuple(self.prompts[self.queue[0] // self.n])
            if p not in self.prefilled and p not in new:  # a prompt this round prefills (choice 7)
                longest = max(longest, len(p))
                if new and (len(new) + 1) * longest > self.engine.options.prefill_tokens:  # its tokens, left-padded
                    break
                new.add(p)
            pages -= need
            rows.append(self.queue.popleft())
        slots = free[:len(rows)]
        self.prefill([tuple(self.prompts[r // self.n]) for r in rows])
        if not rows:
            return
        logits = []
        for s, r in zip(slots, rows):
            p = tuple(self.prompts[r // self.n])
            pre, T = self.prefilled[p], len(p)
            self.cache.attach(s, pre.pages, T)
            self.routes_BSLK[s, :T] = pre.routes_TLK  # (T, L, K)
            logits.append(pre.logits_V)
            self.queued[p] -= 1
            if not self.queued[p]:  # its last row is in: the prompt's own hold on its pages goes
                self.cache.release(self.prefilled.pop(p).pages)
            self.slot_row[s], self.slot_step[s], self.slot_col[s] = r, 1, T  # token 0 is fed at column T
            self.slot_age[s] = self.stats["admissions"] = self.stats["admissions"] + 1
        rows_A, slots_A = torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        self.keys_B[slots_A] = self.keys_X[rows_A]
        ids_A, logp_A = sample(self.vocab(torch.stack(logits)), self.params, row_uniforms(self.keys_X[rows_A], 0))
        self.ids_XC[rows_A, 0], self.logp_XC[rows_A, 0], self.last_B[slots_A] = ids_A, logp_A, ids_A
        for s, stop in zip(slots, torch.isin(ids_A, self.stops).tolist()):
            if stop or self.params.max_new_tokens == 1:
                self.finish(s, stop)

    def prefill(self, prompts: list[tuple]):
        """Prefill, in one forward, the distinct prompts among these that have none yet, and write each into
        pages (the round's left-padded cache is dropped). On the sharded policy the forward runs even when there
        are none (a one-token placeholder, dropped): every rank's round has one."""
        new = list(dict.fromkeys(p for p in prompts if p not in self.prefilled))  # first-seen order
        if not new and not self.engine.sharded:
            return
        self.stats["rounds"] += 1
        if not new:  # joins the other ranks' prefill forward (its all-to-alls)
            self.engine.prefill([(self.engine.pad_id,)])
            return
        cache, logits_UV, routes_UTLK, pad_U = self.engine.prefill(new)
        for u, (p, pad) in enumerate(zip(new, pad_U.tolist())):
            # (L, J, T, d): the prompt's real columns, the round's left padding dropped
            pages = self.cache.write_prompt(cache.k[:, u, :, pad:], cache.v[:, u, :, pad:])
            self.prefilled[p] = Prefilled(pages, logits_UV[u], routes_UTLK[u, pad:])
        self.stats["prefills"] += len(new)

    def step(self):
        """Give each live row the page its next column needs, then one decode step of every slot; sample each
        live row's next token and retire stopped rows."""
        engine, dev, B = self.engine, self.engine.device, self.num_slots
        if self.queue or any(r != IDLE for r in self.slot_row):  # this rank has rows left (choice 8)
            self.stalled_steps += 1
        for s in sorted(range(B), key=self.slot_age.__getitem__):  # the oldest first: it takes from younger rows
            while self.slot_row[s] != IDLE and self.slot_col[s] // self.page_size >= len(self.cache.tables[s]):
                if not self.cache.grow(s):
                    self.make_room(s)
        live = [r != IDLE for r in self.slot_row]
        # the columns any live row attends (a sharded rank whose rows are all done steps with idle slots only)
        W = max((c for c, on in zip(self.slot_col, live) if on), default=0) + 1
        # an idle slot steps at its next column, as a stopped row of the static engine does, kept inside [0, W)
        col_B = torch.tensor([c if on else min(c, W - 1) for c, on in zip(self.slot_col, live)], device=dev)
        # (B, 1, 1, W), broadcast over heads: each slot attends its own columns only
        bias_B11W = torch.zeros(B, 1, 1, W, device=dev).masked_fill_(
            (torch.arange(W, device=dev)[None] > col_B[:, None])[:, None, None], float("-inf"))
        # sharded: fixed-size all-to-alls bounded by `slots` on every rank (choice 5), no host sync per MoE layer
        with capacity_dispatch(engine.model, engine.options.slots) if engine.sharded else nullcontext():
            logits_BV = self.decode(self.last_B, col_B, bias_B11W)  # a CUDA graph's: sampled before the next
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

    def make_room(self, s: int):
        """Free a page for slot s, never an older row's (choice 6): preempt the youngest live row younger than s's,
        or, with none, give back the pages of prompts held for queued rows, or, with none of those, preempt s's
        own row (only a pool below the least does that to the oldest row; the progress guard then stops the call)."""
        younger = [o for o, r in enumerate(self.slot_row) if r != IDLE and self.slot_age[o] > self.slot_age[s]]
        if younger:
            self.preempt(max(younger, key=self.slot_age.__getitem__))
        elif self.prefilled:
            self.give_back_prompts()
        else:
            self.preempt(s)

    def preempt(self, s: int):
        """Send slot s's row back to the head of the queue, its pages returned: generated again from its first token
        when pages allow."""
        r = self.slot_row[s]
        self.cache.detach(s)
        self.slot_row[s] = IDLE
        self.queue.appendleft(r)
        self.queued[tuple(self.prompts[r // self.n])] += 1
        self.stats["preemptions"] += 1

    def give_back_prompts(self):
        """Release the pages of every prompt held for queued rows; they are prefilled again when admitted."""
        for pre in self.prefilled.values():
            self.cache.release(pre.pages)
        self.prefilled.clear()

    def finish(self, s: int, stop: bool):
        """Retire slot s's row: record its length and routes [T + C - 1, L, K] (the tokens it fed), and free the
        slot and its pages."""
        r, c = self.slot_row[s], self.slot_step[s]
        T = len(self.prompts[r // self.n])
        self.length[r], self.stopped[r] = c, stop
        self.stalled_steps = 0
        self.routes[r] = self.routes_BSLK[s, :T + c - 1].clone()  # before the slot's next row overwrites them
        self.cache.detach(s)
        self.slot_row[s] = IDLE

    def no_progress(self) -> str:
        """Why this rank's rows cannot all finish (choice 8), or "" while they can: a row needs at most C - 1 decode
        steps as the oldest, and one row fits an empty pool of the least."""
        C = self.params.max_new_tokens
        if self.stalled_steps >= C:
            return f"no row stopped in {self.stalled_steps} decode steps (a row needs at most {C - 1})"
        if self.queue and all(r == IDLE for r in self.slot_row) and not self.fits(self.queue[0]):
            return "the next row does not fit an empty pool"
        return ""

    def stalled(self) -> str:
        """The progress guard's error (choice 8): why, the engine settings, and this rank's counts."""
        options, stats, C = self.engine.options, self.stats, self.params.max_new_tokens
        T = max(len(p) for p in self.prompts)
        done = sum(1 for c in self.length if c)
        where = " on this rank" if self.engine.sharded else ""
        least = least_pages(T, C, self.page_size) * self.page_size
        return (f"continuous batch made no progress, {self.no_progress() or 'another rank stalled'}: engine.slots="
                f"{options.slots}, engine.kv_tokens={options.kv_tokens}, engine.page_size={self.page_size} "
                f"({self.cache.num_pages} pages) for prompts up to {T} tokens and max_new_tokens={C} "
                f"({stats['decode_steps']} decode steps, {stats['preemptions']} preemptions, {done} of "
                f"{len(self.length)} rows done{where}); a pool of kv_tokens >= {least} (paged_kv.least_pages) always "
                f"finishes")

    def vocab(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """The logits with the vocabulary's padding rows (ids the tokenizer cannot decode) at -inf."""
        num_tokens = self.engine.num_tokens
        if num_tokens is not None and num_tokens < logits_BV.shape[1]:
            logits_BV[:, num_tokens:] = float("-inf")
        return logits_BV


