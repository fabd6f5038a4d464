"""Rollout engines: generate completions with their logprobs and routed expert ids.

`NativeEngine` is a plain PyTorch engine over `model.Transformer`: prefill then decode
over a static KV cache addressed by position (gpt-fast style), batched, with
temperature / top-p sampling from a seeded `torch.Generator`, per-sequence stop on EOS
or the token limit. For every rollout it records what the trainer needs:

- the logprob of each sampled token under softmax(logits / temperature), before top-p
  truncation: the same quantity the trainer computes, so the two can be compared;
- the top-k expert ids every MoE layer used for every token that went through the
  model, in SGLang's layout [prompt_len + completion_len - 1, L, K] (the last sampled
  token is never fed back), which the trainer replays (R3, arXiv 2510.11370);
- the weight version that produced it (set by `update_weights`).

Batches are left-padded so that every row's next token lands in the same cache column;
RoPE positions are per row (column - padding), so a rollout's numbers do not depend on
the batch it was generated in beyond float rounding.

Legend: B rows (prompts x samples), P longest prompt in the batch, S cache columns,
C completion tokens, L MoE layers, K experts per token, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from model import KVCache, ModelConfig, Transformer


@dataclass
class Rollout:
    """One sampled completion of one prompt."""
    prompt_ids: list[int]
    completion_ids: list[int]  # includes the EOS token when finish_reason == "stop"
    logprobs: torch.Tensor  # [C] fp32, engine's log pi(completion token)
    routes: torch.Tensor  # [P + C - 1, L, K] int32 routed expert ids
    finish_reason: str  # "stop" (EOS sampled) or "length" (max_new_tokens reached)
    group_id: int  # index of the prompt in the generate() call; rollouts of one prompt share it
    weight_version: int


def sample(logits_BV: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None):
    """Sampled ids [B] int64 and their logprobs [B] fp32 under softmax(logits / temperature).

    temperature == 0 is greedy (logprobs then under the untempered softmax). top_p < 1
    keeps the smallest set of most likely tokens whose mass reaches top_p (nucleus
    sampling, arXiv 1904.09751); the returned logprob ignores that truncation.
    """
    if temperature == 0:
        ids = logits_BV.argmax(dim=-1)
        return ids, logits_BV.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    logp_BV = (logits_BV / temperature).log_softmax(dim=-1)
    probs = logp_BV.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return ids, logp_BV.gather(-1, ids[:, None]).squeeze(-1)


class NativeEngine:
    """A PyTorch rollout engine holding its own copy of the policy weights."""

    def __init__(self, cfg: ModelConfig, *, eos_id: int, pad_id: int, device="cpu", dtype=torch.float32):
        self.cfg, self.eos_id, self.pad_id = cfg, eos_id, pad_id
        self.device, self.dtype = torch.device(device), dtype
        self.model = Transformer(cfg).to(self.device, dtype).eval().requires_grad_(False)
        self.weight_version = 0

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int):
        """Copy the trainer's weights in (cast to the engine dtype). Every parameter must be sent.

        Raises ValueError on an unknown name, a shape mismatch or a missing parameter.
        """
        params = dict(self.model.named_parameters())
        seen = set()
        for name, t in named_tensors:
            if name not in params:
                raise ValueError(f"update_weights: unknown tensor {name!r}")
            if params[name].shape != t.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
            params[name].copy_(t)
            seen.add(name)
        if missing := params.keys() - seen:
            raise ValueError(f"update_weights: missing {sorted(missing)[:5]} ({len(missing)} in all)")
        self.weight_version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, group_ids: list[int] | None = None) -> list[Rollout]:
        """n rollouts of each prompt, returned prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]).

        Raises ValueError on an empty prompt or one that cannot fit max_new_tokens within max_seq_len.
        """
        if not prompts:
            return []
        lens = [len(p) for p in prompts]
        if min(lens) == 0 or max(lens) + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt lengths span [{min(lens)}, {max(lens)}]; need >= 1 and "
                             f"<= max_seq_len - max_new_tokens = {self.cfg.max_seq_len - max_new_tokens}")
        gen = None
        if seed is not None:
            gen = torch.Generator(self.device).manual_seed(seed)
        rows = [p for p in prompts for _ in range(n)]
        B, P, dev = len(rows), max(lens), self.device
        S = P + max_new_tokens
        pad_B = torch.tensor([P - len(r) for r in rows], device=dev)
        tokens_BP = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            tokens_BP[i, P - len(r):] = torch.tensor(r)
        col_S = torch.arange(S, device=dev)
        key_ok_BS = col_S[None] >= pad_B[:, None]  # left padding is never attended to
        causal_SS = col_S[:, None] >= col_S[None]
        cache = KVCache(self.cfg, B, S, dtype=self.dtype, device=dev)

        # prefill: pad queries may see themselves so their softmax rows are not empty
        mask = (causal_SS[:P, :P] & (key_ok_BS[:, None, :P] | torch.eye(P, dtype=torch.bool, device=dev)))[:, None]
        pos_BP = (col_S[None, :P] - pad_B[:, None]).clamp(min=0)
        logits, routes = self.model(tokens_BP, pos_BT=pos_BP, return_routes=True, cache=cache, cache_start=0, mask_B1TS=mask)
        route_steps = [routes]  # each (B, T, L, K)
        out_ids, out_logp = [], []
        done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        last_BV = logits[:, -1]
        for step in range(max_new_tokens):
            ids_B, logp_B = sample(last_BV, temperature=temperature, top_p=top_p, generator=gen)
            ids_B = ids_B.masked_fill(done_B, self.pad_id)
            out_ids.append(ids_B)
            out_logp.append(logp_B)
            done_B = done_B | (ids_B == self.eos_id)
            if step == max_new_tokens - 1 or bool(done_B.all()):
                break
            col = P + step
            mask = key_ok_BS[:, None, None, :col + 1]  # (B, 1, 1, col+1): causal by construction
            pos = (col - pad_B)[:, None]
            logits, routes = self.model(ids_B[:, None], pos_BT=pos, return_routes=True, cache=cache,
                                        cache_start=col, mask_B1TS=mask)
            route_steps.append(routes)
            last_BV = logits[:, -1]

        ids_BC = torch.stack(out_ids, dim=1).cpu()
        logp_BC = torch.stack(out_logp, dim=1).float().cpu()
        routes_BSLK = torch.cat(route_steps, dim=1).to(torch.int32).cpu()  # (B, P + steps fed, L, K)
        rollouts = []
        for i, prompt in enumerate(rows):
            ids = ids_BC[i].tolist()
            stop = self.eos_id in ids
            C = ids.index(self.eos_id) + 1 if stop else len(ids)
            pad = P - len(prompt)
            rollouts.append(Rollout(
                prompt_ids=list(prompt), completion_ids=ids[:C], logprobs=logp_BC[i, :C].clone(),
                routes=routes_BSLK[i, pad:P + C - 1].clone(), finish_reason="stop" if stop else "length",
                group_id=(group_ids[i // n] if group_ids is not None else i // n),
                weight_version=self.weight_version))
        return rollouts
