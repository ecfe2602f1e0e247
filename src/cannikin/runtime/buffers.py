"""Whose buffers every rank takes before a forward: the rank that trained on the most samples.

DDP broadcasts the module's buffers (BatchNorm's running statistics) from rank 0 before
each forward, so every rank's are the ones rank 0's last forward left. Under DDP rank 0
always has ``B / n`` samples; under an uneven split it may have a few, or none. With none
its running statistics stand still (an empty batch leaves them as they are), and every
rank held, and the model was evaluated with, those of the last step where rank 0 had
samples (three emulated workers, rank 0 the slowest); with two, an average over batches
of two. :func:`broadcast_buffers` sends them instead from the rank with the
largest local batch of the step before, whose forward moved them the most, through DDP's
hook for buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class BufferSource:
    """The rank (in ``group``) whose buffers the others take at the next forward."""

    group: dist.ProcessGroup
    bucket_bytes: int
    rank: int = 0
    """DDP's choice until a step has run: rank 0."""


def broadcast_buffers(source: BufferSource, buffers: dict[str, torch.Tensor]) -> None:
    """DDP's buffer hook (before the forward): its own coalesced broadcast, from
    ``source.rank`` instead of rank 0; done when it returns, as DDP's is."""
    dist._broadcast_coalesced(  # type: ignore[attr-defined]  # DDP's own call
        source.group, list(buffers.values()), source.bucket_bytes, source.rank)
