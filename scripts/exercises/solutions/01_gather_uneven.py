"""Lesson 01, a reference answer: all_gather of uneven tensors (see ../01_gather_uneven.py)."""

import torch
import torch.distributed as dist


def gather_uneven(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (lengths differ), in rank order, on every rank."""
    world = dist.get_world_size()
    result = [tensor] * world  # yours to replace: every rank's tensor, in rank order
    # YOUR CODE: 1. all_gather every rank's length (one number each: the same shape everywhere)
    length = torch.tensor([tensor.shape[0]], device=tensor.device)  # nccl: CUDA tensors only
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    #            2. pad yours to the longest, all_gather the padded tensors
    longest = int(max(lengths).item())
    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    #            3. trim each one to its rank's length: that list is `result`
    result = [g[: int(n.item())] for g, n in zip(gathered, lengths, strict=True)]
    # END YOUR CODE
    return result
