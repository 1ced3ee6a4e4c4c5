"""Lesson 11, a reference answer: a comm hook that sends bf16 (see ../11_bf16_hook.py)."""

# No `from __future__ import annotations`: DDP reads the hook's annotations at run time.
import torch
import torch.distributed as dist


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket of gradients over the ranks, sending it as bfloat16 (half the bytes)."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()  # this bucket's gradients, flat, float32
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)  # a placeholder (nothing sent): replace it, not chain on it
    # YOUR CODE: compress, all_reduce without waiting, decompress when it is done
    compressed = buffer.to(torch.bfloat16).div_(world_size)  # divide first: DDP averages
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])  # back to float32, into the bucket
        return buffer

    future = work.get_future().then(decompress)
    # END YOUR CODE
    return future
