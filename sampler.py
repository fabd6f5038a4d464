"""The sampler and what it records: how every engine samples a completion, and the Rollout it returns.

`SamplingParams` (the run's `sampling` section, as SGLang and vLLM name them), `sample` (temperature,
top-k, top-p by inverse CDF, one uniform per row per step) from per-row random streams (`row_keys`,
`row_uniforms`: keyed by (seed, group id, sample index), so a rollout never depends on its batch-mates
or its rank), and the `Rollout` record both engines return (`RolloutSummary`: what other ranks learn).
Sources: nucleus sampling (arXiv 1904.09751); splitmix64 (Steele, Lea and Flood 2014); router replay
(R3, arXiv 2510.11370), for which every rollout records its routed experts.
Shapes: B, V, C, T, L, K (letters of the README's legend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rules import check_fields, integer, number


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples (SGLang's and vLLM's sampling parameters): the run's `sampling` section (an
    eval's greedy pass: temperature 0). Raises ValueError on a field its rule refuses (`RULES`)."""
    max_new_tokens: int = 24
    """Generation limit per rollout, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy). A run's rollouts need > 0: the trainer's logprobs divide the logits by it."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1] (1 = off)."""
    top_k: int = 0
    """Only the k most likely tokens can be drawn (0 = off)."""

    RULES = {  # each field's type and range (rules.py); not a field: no annotation
        "max_new_tokens": integer(1),
        "temperature": number(0, why="0 = greedy"),
        "top_p": number(0, 1, low_open=True),
        "top_k": integer(0, why="0 = off"),
    }

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class Vocab:
    """What an engine needs of the run's tokenizer: the ids that end a row (one or several: a chat model stops at
    <|im_end|> and at <|endoftext|>), the id that pads, the ids it may sample (0..num_tokens - 1; None: every row of
    the embedding, where a checkpoint's may have more rows than its tokenizer has ids, Qwen3's 151,936 for 151,665)
    and the tokenizer's decode, which gives each Rollout its text (None: rollouts of ids only)."""
    stop_ids: tuple[int, ...]
    pad_id: int = 0
    num_tokens: int | None = None
    decode: Callable[[list[int]], str] | None = None

    def __post_init__(self):
        ids = self.stop_ids
        object.__setattr__(self, "stop_ids", (ids,) if isinstance(ids, int) else tuple(ids))


@dataclass
class Rollout:
    """One sampled completion of one prompt, whichever engine produced it."""
    prompt_ids: list[int]
    completion_ids: list[int]  # includes the EOS token when finish_reason == "stop"
    logprobs: torch.Tensor  # [C] fp32, engine's log pi(completion token): pi_infer, before top-k/top-p truncation
    # [T + C - 1, L, K] routed expert ids (model.route_dtype: uint8 up to 256 experts), T this prompt's tokens:
    # every token fed to the model, i.e. all but the last completion token, whose logits are never computed
    # (SGLang's layout; replayed by the trainer)
    routes: torch.Tensor
    finish_reason: str  # "stop" (EOS sampled) or "length" (max_new_tokens reached)
    group_id: int  # index of the prompt in the generate() call (or group_ids[i]); rollouts of one prompt share it
    weight_version: int  # the engine's version when it generated this rollout (staleness = trainer's - this)
    # one 0/1 per completion_ids entry: 0 where the model did not sample the token (a tool's response, fed to the
    # model as input but never trained, its logprob never read); None = every completion token trained
    loss_mask: list[int] | None = None
    # what a verifier, a reward model or a judge reads: text_ids decoded by the run's tokenizer, set by an engine
    # built with its decode (rollout.ENGINES' builders); None from one built without (tests that read ids only)
    text: str | None = None
    # a multi-turn row's (tool_rollout.ToolEngine): its assistant turns, the tool calls it made, how many failed
    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_trained(self) -> int:
        """Completion tokens the loss trains: the token-mean loss's normaliser counts these."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def text_ids(self) -> list[int]:
        """The completion without its stop token: the ids whose text a verifier, a reward model or a judge reads."""
        return self.completion_ids[:-1] if self.finish_reason == "stop" else self.completion_ids

    def summary(self, rank: int, with_tokens: bool = False) -> RolloutSummary:
        """Its scalars, for the other ranks (with the completion's ids and text if with_tokens)."""
        return RolloutSummary(len(self.prompt_ids), len(self.completion_ids), self.num_trained, self.finish_reason,
                              self.group_id, self.weight_version, rank,
                              list(self.completion_ids) if with_tokens else None, self.text if with_tokens else None,
                              self.tool_calls, self.tool_failures)


@dataclass(frozen=True)
class RolloutSummary:
    """What the other ranks learn of a rollout: its scalars, never its tokens, logprobs or routes (those
    stay on the rank that generated it, which trains it). completion_ids and text only when reward shaping
    reads the group's completions."""
    prompt_len: int
    num_tokens: int  # generated tokens, tool tokens included
    num_trained: int  # those the loss trains (Rollout.num_trained): the token-mean normaliser's count
    finish_reason: str
    group_id: int
    weight_version: int
    rank: int
    completion_ids: list[int] | None = None
    text: str | None = None
    tool_calls: int = 0  # a multi-turn row's (Rollout.tool_calls, tool_failures): the failed-call penalty reads them
    tool_failures: int = 0


def texts(rollouts: list[Rollout]) -> list[str]:
    """Each rollout's text (Rollout.text), what the step's verifiers and scorers read. Raises ValueError for rollouts
    an engine left undecoded (built without the tokenizer's decode: rollout.ENGINES' builders pass it)."""
    if any(r.text is None for r in rollouts):
        raise ValueError(f"{sum(r.text is None for r in rollouts)} of {len(rollouts)} rollouts have no text: build the "
                         f"engine with decode=tok.decode (rollout.ENGINES' builders do)")
    return [r.text for r in rollouts]


def sample(logits_BV: torch.Tensor, params: SamplingParams, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids [B] int64 and their logprobs [B] fp32 under softmax(logits / temperature).

    temperature == 0 is greedy (logprobs then under the untempered softmax). top_k > 0
    keeps the k most likely tokens; top_p < 1 then keeps the smallest set of most likely
    tokens whose mass reaches top_p of what is left (nucleus sampling, arXiv 1904.09751);
    the returned logprob ignores both truncations. Each row draws one uniform u and takes
    the first token whose cumulative probability exceeds u * total (inverse-CDF sampling,
    in float64 so u * total stays below the total): one random number per row, where
    torch.multinomial or a Gumbel/exponential race spend one per vocabulary entry (on
    CPU those dominate the sampler's time). A token of zero probability is never drawn.
    u_B: the rows' uniforms in [0, 1) (float64, from `row_uniforms`).
    """
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    logits_BV = logits_BV.float()  # fp32 whatever the engine dtype, as the trainer's (logprobs.chunked_logprobs)
    if temperature == 0:
        logp_BV = logits_BV.log_softmax(dim=-1)  # dividing by temperature 0 is undefined: report the untempered logprob
        ids_B = logp_BV.argmax(dim=-1)
        return ids_B, logp_BV.gather(-1, ids_B[:, None]).squeeze(-1)  # (B, 1) -> (B,)
    # log pi(v) = z_v / tau - logsumexp(z / tau): the recorded logprob, before any truncation
    logp_BV = (logits_BV / temperature).log_softmax(dim=-1)
    probs_BV = logp_BV.exp()
    # Truncations zero probabilities and never renormalise: the draw below scales u by what is left.
    if 0 < top_k < probs_BV.shape[-1]:
        top = probs_BV.topk(top_k, dim=-1)  # values and indices (B, k)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, top.indices, top.values)  # (B, V), 0 outside the top k
    if top_p < 1.0:
        sorted_p, order = probs_BV.sort(dim=-1, descending=True)  # (B, V); order[b, i] is the vocab id of rank i
        cum = sorted_p.cumsum(-1)
        # the total mass cum[:, -1:] is what top-k left; the most likely token always stays (0 mass before it)
        drop = cum - sorted_p >= top_p * cum[:, -1:]  # mass before this token already reaches top_p
        probs_BV = probs_BV.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))  # (B, V): ranks back to vocab order
    # Inverse CDF: the first id whose cumulative mass exceeds u * total. right=True makes it the first cdf > u * total,
    # so a zero-mass token (cdf equal to its predecessor's) is never it. float64, not fp32: u < 1 stays < 1 (u near 1
    # would round to 1.0 in fp32) and u * total rounds below the total, so the id is always < V.
    cdf_BV = probs_BV.double().cumsum(dim=-1)  # (B, V)
    u_B1 = u_B.to(torch.float64)[:, None]  # (B, 1)
    ids_B = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True).squeeze(-1)  # (B, 1) -> (B,)
    return ids_B, logp_BV.gather(-1, ids_B[:, None]).squeeze(-1)  # (B,) under the untruncated tempered softmax


# ----------------------------------------------------------------------------- per-row random streams
# A counter-based generator: the uniform of (row key, step) is a hash of the pair, so a
# rollout's random numbers depend on its seed, group id and sample index only, never on
# which other prompts share its batch or in what order (a multi-rank run then samples
# what one process would). One stateful torch.Generator per row would do the same at one
# kernel launch per row per step; the hash is a handful of elementwise int64 ops for all
# rows at once, on any device.
# torch has no uint64 arithmetic, so the hash runs on int64: two's-complement products and
# sums wrap mod 2^64 and keep the same bits as splitmix64's unsigned ones; only >> differs,
# hence `_srl`.

_MIX1, _MIX2 = -4658895280553007687, -7723592293110705685  # 0xbf58476d1ce4e5b9, 0x94d049bb133111eb as int64
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64: the stream increment
_MANTISSA = (1 << 53) - 1  # a float64 holds 53 significant bits


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> s) & ((1 << (64 - s)) - 1)  # the mask clears the s copies of the sign bit that >> shifted in


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): a bijective 64-bit hash
    (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators")."""
    # xor-shift and multiply by an odd constant are each invertible mod 2^64, so the whole hash is a bijection
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


def row_keys(seed: int, group_ids: list[int], sample_index: list[int], device=None) -> torch.Tensor:
    """int64 [B] stream keys of rows (seed, group id, sample index): equal triples, equal streams."""
    g = torch.tensor(group_ids, dtype=torch.int64, device=device)  # (B,)
    j = torch.tensor(sample_index, dtype=torch.int64, device=device)  # (B,)
    # a hash between the xors: (g, j) pairs with equal g ^ j or g + j still get unrelated keys
    return mix64(mix64(mix64(torch.full_like(g, seed)) ^ g) ^ j)


def row_uniforms(keys_B: torch.Tensor, step: int) -> torch.Tensor:
    """float64 [B] uniforms in [0, 1), the step-th draw of each row's stream (53 random bits each)."""
    # splitmix64 seeded with the key: its (step + 1)-th output is mix64(key + (step + 1) * golden), so any draw
    # is computed directly from (key, step), with no state carried between steps
    offset = ((step + 1) * _GOLDEN + (1 << 63)) % (1 << 64) - (1 << 63)  # wrapped to int64 like the tensor sum
    # the top 53 bits over 2^53, as Java's SplittableRandom.nextDouble: a multiple of 2^-53 in [0, 1), never 1.0
    return (_srl(mix64(keys_B + offset), 11) & _MANTISSA).double() * 2.0 ** -53


def row_uniforms_at(keys_B: torch.Tensor, step_B: torch.Tensor) -> torch.Tensor:
    """`row_uniforms` with a draw index per row, step_B [B] int64: float64 [B] in [0, 1).

    splitmix64's counter is additive (draw t of key k hashes k + (t + 1) * golden, wrapping mod 2^64), so
    draw t of key k is draw 0 of key k + t * golden: the same bits as row_uniforms(keys, t) row by row.
    """
    return row_uniforms(keys_B + step_B * _GOLDEN, 0)  # int64 products and sums wrap, as the stream's own

