"""The policy's weights on the move: to an engine, a checkpoint or an HF export.

`policy_tensors` names every tensor a model's weights consist of (a tied one once),
`full_tensor` gathers a sharded one whole, `local` is this rank's shard, and `weight_buckets`
cuts a stream of tensors into transfers of bounded size (the engines' weight sync, hf.save_hf's
shards). Nothing here imports torch.distributed: a DTensor is recognised by its methods.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn as nn

Named = Iterable[tuple[str, torch.Tensor]]
"""(name, tensor) pairs under state-dict names: what a weight sync or an export takes."""
DEFAULT_BUCKET_BYTES = 512 << 20
"""Weight-sync bucket: bounds the staging memory and sets the size of one transfer."""


def policy_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied lm_head once, as the embedding) and persistent buffer (GLM-4.5's
    expert_bias) of a model, detached, under its state-dict names: what an engine, a checkpoint or
    an HF export takes. Sharded parameters come as their local DTensors (`full_tensor` gathers)."""
    seen = set()
    # state_dict names drop activation checkpointing's wrapper and leave out non-persistent buffers
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied weight appears under both its names: send it once
            seen.add(id(t))
            yield name, t.detach()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank of its mesh must call it), else t, detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def weight_buckets(named_tensors: Named, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most bucket_bytes each (a larger tensor alone), in order."""
    bucket, size = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:  # `bucket and`: never an empty bucket; a larger tensor goes alone
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (t itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
