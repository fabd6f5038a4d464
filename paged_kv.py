"""A paged key/value cache for continuous batching (batching.ContinuousBatch, engine.page_size / engine.kv_tokens):
keys and values live in fixed-size pages of p columns that a call's slots share through a page table, given to
rows as they grow and returned when they stop (PagedAttention, arXiv 2309.06180), so a call's KV memory follows
its live tokens, not rows x max length. Shapes: F pages, p columns a page (a slot's page table holds as many pages as its longest row needs), the
rest as in the README's legend (L layers, B slots, J kv heads, W columns attended, d head dim).

Notable choices:
1. Page 0 is scratch: a slot's table entries past its own pages, and an idle slot's whole table, point at it.
   An idle slot's padding step writes there; a live row's gathered window reads it only past its own
   column, where its bias is -inf, as it reads stale columns of a freed page.
2. Attention reads a slot's pages through a gather into [B, J, W, d], one layer at a time (a transient copy of
   one layer's window, the size of one layer of a static cache); the static cache's columns [0, W) and the
   gathered ones agree on every column a row attends and the rest are masked, so logits equal a static cache's
   bit for bit. A paged-attention kernel (FlashInfer's, vLLM's) would read the pages in place on a GPU.
3. A prompt's prefill is written into pages once (`write_prompt`); its full pages are shared by every row of the
   prompt (reference counts; a row writes only past its prompt, so no shared page is ever written), and its
   last, partial page is copied into a page of each admitted row's own (`attach`: copy at admission, at most
   p - 1 columns a row, which the row then decodes into). Copy-on-write would save those columns and cost a
   check in every decode step's write; the copy is bounded, and measured in bench/continuous.py's table.
4. Host-side bookkeeping: the free list, reference counts and each slot's pages are Python lists; the device
   holds the pages and the table [B, pages a slot can hold] that a decode step reads, rewritten only when a slot's pages change.
"""

from __future__ import annotations

import torch

from model import ModelConfig

SCRATCH = 0
"""The page every unused table entry points at (choice 1); never given to a row."""
PAGE_SIZE = 16
"""engine.page_size's default: columns a page (vLLM's default block size); a row wastes under one page."""
PREFILL_TOKENS = 16384
"""engine.prefill_tokens' default: prompt tokens an admission round prefills at most (SGLang's max_prefill_tokens)."""


def pages_for(columns: int, page_size: int) -> int:
    """Pages that hold `columns` columns."""
    return -(-columns // page_size)


def least_pages(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """The least pool a continuous batch accepts: one row at full length (its prompt and every sampled token but the
    last) beside its prompt's own pages. Every call in it finishes: the oldest live row takes pages from younger
    rows and held prompts, never the reverse, and at full length holds no more than the first term; one row at
    admission (its prompt's pages and its copy of the last) fits as well (batching.ContinuousBatch's choice 6)."""
    return pages_for(prompt_tokens + max_new_tokens - 1, page_size) + pages_for(prompt_tokens, page_size)


def pool_pages(slots: int, prompt_tokens: int, max_new_tokens: int, page_size: int, kv_tokens: int) -> int:
    """Pages of a continuous batch's pool (scratch aside): kv_tokens' worth, or with kv_tokens = 0 every slot at full
    length beside one prompt's pages (at most one prompt is held for queued rows until something is preempted)."""
    if kv_tokens:
        return kv_tokens // page_size
    return slots * pages_for(prompt_tokens + max_new_tokens - 1, page_size) + pages_for(prompt_tokens, page_size)


def too_few_pages(kv_tokens: int, prompt_tokens: int, max_new_tokens: int, page_size: int) -> str:
    """Why kv_tokens (> 0) cannot hold a call of prompts up to prompt_tokens long, or "" when it can."""
    least = least_pages(prompt_tokens, max_new_tokens, page_size) * page_size
    if kv_tokens >= least:
        return ""
    return (f"kv_tokens={kv_tokens}: prompts of up to {prompt_tokens} tokens with max_new_tokens={max_new_tokens} "
            f"need at least {least} (one row at full length beside its prompt's pages, in pages of page_size="
            f"{page_size}), or 0 (every slot at full length)")


class PagedKVCache:
    """Keys and values [L, F + 1, J, p, d] (page 0 scratch) and a page table [B, pages a slot can hold] per slot.

    `update_rows` is model.KVCache's, so the model's attention decodes over either. Pages are handed out by
    `alloc`, shared by `share` and returned by `release` (reference counted); `attach`/`grow`/`detach` move a
    slot's table. `peak` is the most pages in use at once (prompt pages and rows' together)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, num_pages: int, page_size: int, max_len: int, *,
                 dtype, device):
        shape = (cfg.n_layers, num_pages + 1, cfg.n_kv_heads, page_size, cfg.head_dim)  # (L, F + 1, J, p, d)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size, self.num_pages = page_size, num_pages
        self.page_table = torch.full((num_slots, pages_for(max_len, page_size)), SCRATCH, dtype=torch.long,
                                   device=device)
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]  # each slot's pages, host side
        self.free = list(range(num_pages, 0, -1))  # pop() hands out the lowest page first
        self.refs = [0] * (num_pages + 1)
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self.free)

    def alloc(self) -> int | None:
        """A free page, held once; None when every page is in use."""
        if not self.free:
            return None
        page = self.free.pop()
        self.refs[page] = 1
        self.peak = max(self.peak, self.in_use)
        return page

    def share(self, page: int):
        self.refs[page] += 1

    def release(self, pages: list[int]):
        """Drop one hold on each page; a page nobody holds goes back to the free list."""
        for page in pages:
            self.refs[page] -= 1
            if not self.refs[page]:
                self.free.append(page)

    def write_prompt(self, k_LJTd: torch.Tensor, v_LJTd: torch.Tensor) -> list[int]:
        """Write a prompt's keys and values (its T real columns) into pages_for(T) new pages, held once (the
        prompt's own hold, released when its last row is admitted). The caller checked that they are free."""
        T, p = k_LJTd.shape[2], self.page_size
        pages = [self.alloc() for _ in range(pages_for(T, p))]
        for i, page in enumerate(pages):
            cols = slice(i * p, min(T, (i + 1) * p))
            self.k[:, page, :, :cols.stop - cols.start] = k_LJTd[:, :, cols]
            self.v[:, page, :, :cols.stop - cols.start] = v_LJTd[:, :, cols]
        return pages

    def attach(self, s: int, prompt_pages: list[int], T: int):
        """Give slot s its prompt of T columns: the full pages shared, the partial last one copied into a page of
        its own (choice 3). Needs one free page when T is not a multiple of p."""
        full = T // self.page_size
        for page in prompt_pages[:full]:
            self.share(page)
        table = prompt_pages[:full]
        if T % self.page_size:
            own = self.alloc()
            self.k[:, own], self.v[:, own] = self.k[:, prompt_pages[full]], self.v[:, prompt_pages[full]]
            table = table + [own]
        self.tables[s] = table
        self.page_table[s, :len(table)] = torch.tensor(table, dtype=torch.long)

    def grow(self, s: int) -> bool:
        """One more page at the end of slot s's table; False when none is free."""
        page = self.alloc()
        if page is None:
            return False
        self.page_table[s, len(self.tables[s])] = page
        self.tables[s].append(page)
        return True

    def detach(self, s: int):
        """Return slot s's pages and point its table at scratch."""
        self.release(self.tables[s])
        self.tables[s] = []
        self.page_table[s] = SCRATCH

    def update_rows(self, layer: int, col_B: torch.Tensor, k_BJ1d, v_BJ1d, width: int):
        """model.KVCache.update_rows over pages: row b's token goes to column col_B[b] % p of its table's page
        col_B[b] // p; returns columns [0, width) of every row gathered from its pages, [B, J, width, d] each."""
        p = self.page_size
        page_B = self.page_table.gather(1, (col_B // p)[:, None])[:, 0]  # (B,)
        # advanced indices on dims 0 and 2 of (F + 1, J, p, d) around a slice: the indexed dims are (B, J, d)
        self.k[layer][page_B, :, col_B % p] = k_BJ1d[:, :, 0]
        self.v[layer][page_B, :, col_B % p] = v_BJ1d[:, :, 0]
        pages = self.page_table[:, None, :pages_for(width, p)]  # (B, 1, the pages that hold columns [0, width))
        heads_1J1 = torch.arange(self.k.shape[2], device=col_B.device)[None, :, None]

        def window(x_FJpd):  # indexed on its pages and heads at once: (B, J, those pages, p, d), one copy, then a view
            return x_FJpd[pages, heads_1J1].flatten(2, 3)[:, :, :width]
        return window(self.k[layer]), window(self.v[layer])
