"""Gather tensors whose first dimension differs from rank to rank: pad, all_gather, trim.

``dist.all_gather(out, t)`` requires every rank's ``t`` to have the *same*
shape: each rank sizes its receive buffers from what it expects, and nothing
checks. Per-rank predictions of an unpadded validation shard (lesson 02's
exact evaluation gives ranks 151 and 150 samples), variable-length token
lists or detections are not the same size. On gloo the mismatch aborts the
rank that receives more bytes than it expected (``Received data size doesn't
match expected size``) and can hand the other rank whatever its buffers held;
on nccl it can hang or silently return garbage (lesson 01 runs it on gloo).

:func:`all_gather_uneven` does what works everywhere, in two collectives:

1. all_gather every rank's length (one int64 per rank: same shape everywhere);
2. pad the local tensor along dim 0 to the longest length, all_gather the
   padded tensors (same shape everywhere now), and trim each to its length.

``dist.all_gather_object`` gives the same result for any picklable object,
but pickles on the CPU and, with nccl, copies through the GPU: fine for a
few numbers, slow for big tensors. Lesson 01 asserts that the two agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_sizes(
    length: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> list[int]:
    """Every rank's ``length``, in rank order (one int64 all_gather: same shape everywhere)."""
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    return [int(s.item()) for s in sizes]


def all_gather_uneven(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """``tensor`` from every rank, in rank order, though ranks differ in ``tensor.shape[0]``.

    The other dimensions and the dtype must match across ranks (as for a
    ``torch.cat`` of the result); a 0-d tensor counts as one element. Every
    rank must call it, as any collective.
    """
    local = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    sizes = all_gather_sizes(local.shape[0], local.device, group)
    padded = local.new_zeros((max(sizes), *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [g[:n] for g, n in zip(gathered, sizes, strict=True)]
