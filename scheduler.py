"""Length-aware scheduling and the bounded-staleness rollout/train pipeline.

Owns how a step's work is laid out: `LengthPredictor` (a prompt's completion length),
`length_buckets` (generation batches of similar predicted length), `generation_batches` (one
step's batches, each dealt over the ranks) and `Pipeline` (a producer thread that generates
rollouts at most `max_staleness` weight versions behind the trainer). The trainer packs its own
micro-batches (trainer.pack_microbatches). Papers: "Each Prompt Matters" (arXiv 2512.07710), whose
system measures include length-based load balancing and rollout overlapped with training.

Notable choices:
1. Why lengths: in a batched engine a generation batch runs until its longest member
   stops, and every row pays for the padding of the longest prompt, so mixing short and
   long rollouts wastes the short rows' compute; across ranks, the slowest rank sets
   the step time. The seed paper reports a 1.66x cumulative speed-up from its system
   measures, length-based load balancing among them (arXiv 2512.07710).
2. `LengthPredictor` answers from a prompt's own history, else the mean for its task and
   prompt-length bucket, else the mean of all completions, else a prior.
3. Load balance across ranks: each length bucket is dealt round-robin over the ranks in its
   longest-first order, so every rank gets neighbours in length (about the same predicted
   work) and every rank computes the same split unaided; ranks decode in lockstep, so a
   batch's time is its longest row's on the slowest rank.
4. `Pipeline` publishes weights with a version (the number of RL steps trained);
   the producer applies the newest published weights between batches and never starts
   batch s with weights older than s - max_staleness, so 0 is synchronous on-policy RL.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import Any, Callable

PROMPT_LEN_BUCKET = 64  # prompts within this many tokens share a fallback length estimate


class LengthPredictor:
    """Predicts completion length (tokens) per prompt key from history, with fallbacks.

    The fallbacks, in order: the mean for the prompt's (task, prompt-length bucket), the
    mean of all completions seen, `prior`. state_dict / load_state_dict carry it through
    checkpoints.
    """

    def __init__(self, prior: float):
        self.prior = prior
        # every completion length a prompt key got: all its rollouts, in every step it was drawn in
        self.history: dict = defaultdict(list)
        # (task, prompt-length bucket) -> [sum, count] of completion lengths
        self.by_bucket: dict = defaultdict(lambda: [0.0, 0])
        self.total, self.count = 0.0, 0  # over every completion: the fallback for an unseen bucket

    def observe(self, key, length: int, *, task=None, prompt_len: int = 0):
        self.history[key].append(length)
        # a new prompt of the same task and similar prompt length is likely to get a similar completion length
        b = self.by_bucket[task, prompt_len // PROMPT_LEN_BUCKET]
        b[0] += length
        b[1] += 1
        self.total += length
        self.count += 1

    def predict(self, key, *, task=None, prompt_len: int = 0) -> float:
        seen = self.history.get(key)
        if seen:  # the prompt's own past completions: the most specific estimate there is
            return sum(seen) / len(seen)
        # .get, not [...]: a prediction must not insert an empty bucket into the defaultdict
        b = self.by_bucket.get((task, prompt_len // PROMPT_LEN_BUCKET))
        if b and b[1]:
            return b[0] / b[1]
        return self.total / self.count if self.count else self.prior

    def state_dict(self) -> dict:
        # plain dicts: a defaultdict's lambda factory cannot be pickled into a checkpoint
        return {"prior": self.prior, "history": dict(self.history), "by_bucket": dict(self.by_bucket),
                "total": self.total, "count": self.count}

    def load_state_dict(self, state: dict):
        self.prior, self.total, self.count = state["prior"], state["total"], state["count"]
        self.history = defaultdict(list, state["history"])
        # "by_group": the key's name in checkpoints written before it was renamed
        buckets = state["by_bucket"] if "by_bucket" in state else state["by_group"]
        self.by_bucket = defaultdict(lambda: [0.0, 0], buckets)


def length_buckets(predicted_lengths: list[float], batch_size: int) -> list[list[int]]:
    """Indices cut into batches of <= batch_size with similar predicted lengths (longest first).

    Raises ValueError if batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    # a batch decodes until its longest row ends: consecutive cuts of the sorted order keep each batch's rows
    # close to its longest, so little compute goes to rows that have already stopped. The sort is stable
    # (ties keep index order), so every rank cuts the same batches from the same predictions.
    order = sorted(range(len(predicted_lengths)), key=lambda i: -predicted_lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generation_batches(predictor: LengthPredictor, requests: list[tuple], prompts_per_batch: int, *,
                       num_ranks: int = 1, rank: int = 0) -> list[list[int]]:
    """This rank's share of each generation batch of a step's prompts (request indices; a share may be empty).

    requests: (key, task, prompt_len) of each prompt; each is predicted to take prompt_len plus
    its predicted completion tokens. Batches of <= prompts_per_batch prompts per rank and similar
    lengths (`length_buckets`), longest first; each batch spans every rank, dealt round-robin in
    its longest-first order, so every rank is busy, holds at most prompts_per_batch prompts (what its
    KV cache is sized for) and gets about the same predicted work (its neighbours in length).
    Every rank computes the same split and gets as many shares as there are batches: ranks
    that decode in lockstep (the sharded engine) make the same calls.
    """
    predicted = [n + predictor.predict(key, task=task, prompt_len=n) for key, task, n in requests]
    return [sorted(bucket[rank::num_ranks]) for bucket in length_buckets(predicted, prompts_per_batch * num_ranks)]


class Pipeline:
    """Producer thread for rollout batches, at most `max_staleness` RL steps ahead of the trainer.

    produce(step) -> batch runs on the producer thread after `apply(weights, version)` has
    loaded the newest published weights into the engine; the trainer calls `next()` for
    each step's batch and `publish(weights, version)` after each RL step's update. A batch
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
        # no maxsize: the version gate in _run already keeps the producer at most max_staleness + 1 batches
        # ahead of the trainer's next(), so a second bound would only be a second place to keep in step
        self.batches: queue.Queue = queue.Queue()
        self.cond = threading.Condition()  # guards published, version and stopped, shared by both threads
        # only the newest snapshot is kept: a version published while the producer was generating replaces
        # the one before it, which no batch would use anyway
        self.published: tuple[Any, int] | None = None  # (weights, version) not yet applied
        self.version = start_version  # newest version published
        self.stopped = False
        # daemon: a producer stuck inside produce() must not keep the interpreter alive after the trainer ends
        self.thread = threading.Thread(target=self._run, args=(start_step, steps), daemon=True)
        self.thread.start()

    def _run(self, start: int, steps: int):
        try:
            for step in range(start, steps):
                # The version gate. The trainer trains on batch s with version s (s RL steps trained), so a
                # batch started with version >= s - max_staleness is at most max_staleness versions stale. A sync
                # step waits for version s, the weights the trainer publishes only after its checkpoint.
                oldest = step if self.sync_before(step) else step - self.max_staleness  # the oldest weights allowed
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self.version >= oldest)
                    if self.stopped:
                        return
                    pending, self.published = self.published, None
                # applied outside the lock: loading weights is slow, and publish() must not block the trainer
                if pending is not None:
                    self.apply(*pending)
                self.batches.put(("ok", self.produce(step)))
        except BaseException as e:  # handed to the trainer, which re-raises it
            self.batches.put(("error", e))

    def next(self):
        """The next step's batch; raises what the producer raised, or TimeoutError."""
        try:
            # a timeout turns a producer that hangs (a stuck engine) into an error instead of a silent stall
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
            self.cond.notify_all()  # wakes a producer waiting at the version gate

    def close(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        # bounded: a producer inside produce() sees `stopped` only at its next gate; the thread is a daemon
        self.thread.join(timeout=self.timeout)
