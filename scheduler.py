"""Length-aware scheduling and the bounded-staleness rollout/train pipeline.

In a batched engine a generation batch runs until its longest member stops, and every
row pays for the padding of the longest prompt, so mixing short and long rollouts wastes
the short rows' compute; across workers, the slowest worker sets the step time. The
seed paper (arXiv 2512.07710) reports 1.66x cumulative speed-up with length-based load
balancing among its system measures, and overlaps rollout with training. This file:

- `LengthPredictor`: a prompt's completion length from its own history, else the mean
  for its task and prompt-length bucket, else the mean of all completions, else a prior;
- `length_buckets`: sort prompts by predicted length and cut the order into generation
  batches, so each batch holds similar lengths;
- `balance`: longest-processing-time-first assignment of predicted work to workers
  (Graham 1969: within 4/3 of the optimal makespan);
- `pack_microbatches`: first-fit-decreasing packing of training sequences into
  micro-batches whose padded size (rows x longest row) stays within a token budget;
- `Pipeline`: a rollout producer thread that runs up to `max_staleness` steps ahead of the
  trainer. Weights are published with a version (the number of optimizer steps taken);
  the producer applies the newest published weights between batches and never starts
  batch s with weights older than s - max_staleness, so 0 is synchronous on-policy RL.
"""

from __future__ import annotations

import heapq
import queue
import threading
from collections import defaultdict
from typing import Any, Callable

PROMPT_LEN_BUCKET = 64  # prompts within this many tokens share a fallback length estimate


class LengthPredictor:
    """Predicts completion length (tokens) per prompt key from history, with fallbacks."""

    def __init__(self, prior: float):
        self.prior = prior
        self.history: dict = defaultdict(list)
        self.by_group: dict = defaultdict(lambda: [0.0, 0])  # (task, prompt-length bucket) -> [sum, count]
        self.total, self.count = 0.0, 0

    def observe(self, key, length: int, *, task=None, prompt_len: int = 0):
        self.history[key].append(length)
        g = self.by_group[task, prompt_len // PROMPT_LEN_BUCKET]
        g[0] += length
        g[1] += 1
        self.total += length
        self.count += 1

    def predict(self, key, *, task=None, prompt_len: int = 0) -> float:
        seen = self.history.get(key)
        if seen:
            return sum(seen) / len(seen)
        g = self.by_group.get((task, prompt_len // PROMPT_LEN_BUCKET))
        if g and g[1]:
            return g[0] / g[1]
        return self.total / self.count if self.count else self.prior

    def state_dict(self) -> dict:
        return {"prior": self.prior, "history": dict(self.history), "by_group": dict(self.by_group),
                "total": self.total, "count": self.count}

    def load_state_dict(self, state: dict):
        self.prior, self.total, self.count = state["prior"], state["total"], state["count"]
        self.history = defaultdict(list, state["history"])
        self.by_group = defaultdict(lambda: [0.0, 0], state["by_group"])


def length_buckets(predicted_lengths: list[float], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of <= batch_size with similar predicted lengths (longest first).

    Raises ValueError if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    order = sorted(range(len(predicted_lengths)), key=lambda i: -predicted_lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def balance(costs: list[float], num_workers: int) -> list[list[int]]:
    """Indices split over num_workers, largest cost first to the least-loaded worker (LPT).

    Raises ValueError if num_workers < 1.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers} must be >= 1")
    heap = [(0.0, w) for w in range(num_workers)]  # (load, worker)
    assigned: list[list[int]] = [[] for _ in range(num_workers)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, w = heapq.heappop(heap)
        assigned[w].append(i)
        heapq.heappush(heap, (load + costs[i], w))
    return assigned


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


class Pipeline:
    """Producer thread for rollout batches, at most `max_staleness` optimizer steps ahead.

    produce(step) -> batch runs on the producer thread after `apply(weights, version)` has
    loaded the newest published weights into the engine; the trainer calls `next()` for
    each step's batch and `publish(weights, version)` after each optimizer step. A batch
    for step s is only started once a version >= s - max_staleness is published; with
    max_staleness 0 the producer waits for every update (synchronous). A step s with
    sync_before(s) true waits for version s itself: nothing of it is drawn or generated
    before the trainer publishes the weights of step s - 1, so the trainer can checkpoint a
    state no rollout has run ahead of (then publish). An exception in the producer is
    raised again in the trainer's `next()`, never lost.
    """

    def __init__(self, produce: Callable[[int], Any], apply: Callable[[Any, int], None], *, steps: int,
                 max_staleness: int, start_step: int = 0, start_version: int = 0, timeout: float | None = None,
                 sync_before: Callable[[int], bool] | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        self.produce, self.apply, self.max_staleness, self.timeout = produce, apply, max_staleness, timeout
        self.sync_before = sync_before or (lambda step: False)
        self.batches: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.published: tuple[Any, int] | None = None  # (weights, version) not yet applied
        self.version = start_version  # newest version published
        self.stopped = False
        self.thread = threading.Thread(target=self._run, args=(start_step, steps), daemon=True)
        self.thread.start()

    def _run(self, start: int, steps: int):
        try:
            for step in range(start, steps):
                oldest = step if self.sync_before(step) else step - self.max_staleness  # the oldest weights allowed
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self.version >= oldest)
                    if self.stopped:
                        return
                    pending, self.published = self.published, None
                if pending is not None:
                    self.apply(*pending)
                self.batches.put(("ok", self.produce(step)))
        except BaseException as e:  # handed to the trainer, which re-raises it
            self.batches.put(("error", e))

    def next(self):
        """The next step's batch; raises what the producer raised, or TimeoutError."""
        try:
            kind, value = self.batches.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"no rollout batch within {self.timeout}s") from None
        if kind == "error":
            raise value
        return value

    def publish(self, weights, version: int):
        """Hand new weights (a snapshot the trainer will not modify) to the producer."""
        with self.cond:
            self.published, self.version = (weights, version), version
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=self.timeout)
