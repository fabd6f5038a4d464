"""Length-aware scheduling: predict completion lengths, bucket generation batches, pack micro-batches.

In a batched engine a generation batch runs until its longest member stops, and every
row pays for the padding of the longest prompt, so mixing short and long rollouts
wastes the short rows' compute (the seed paper, arXiv 2512.07710, reports 1.66x from
length-based load balancing among its system measures). This first step:

- `LengthPredictor`: the mean of a prompt's own past completion lengths, else a
  fallback (the running mean of all completions seen, or a configured prior);
- `length_buckets`: sort prompts by predicted total length (prompt + completion) and cut
  the order into generation batches, so each batch holds similar lengths;
- `pack_microbatches`: first-fit-decreasing packing of training sequences into
  micro-batches whose padded size (rows x longest row) stays within a token budget.
"""

from __future__ import annotations

from collections import defaultdict


class LengthPredictor:
    """Predicts completion length (tokens) per prompt key from history."""

    def __init__(self, prior: float):
        self.prior = prior
        self.history: dict = defaultdict(list)
        self.total, self.count = 0.0, 0

    def observe(self, key, length: int):
        self.history[key].append(length)
        self.total += length
        self.count += 1

    def predict(self, key) -> float:
        seen = self.history.get(key)
        if seen:
            return sum(seen) / len(seen)
        return self.total / self.count if self.count else self.prior


def length_buckets(predicted_lengths: list[float], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of <= batch_size with similar predicted lengths (longest first).

    Raises ValueError if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    order = sorted(range(len(predicted_lengths)), key=lambda i: -predicted_lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def pack_microbatches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices packed so that len(mb) * max(lengths in mb) <= token_budget (padding counted).

    Longest first, each micro-batch filled until the next sequence would break the budget.
    A sequence longer than the budget gets a micro-batch of its own.
    Raises ValueError if token_budget < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        # sorted descending, so the first member is the longest and sets the padded width
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
