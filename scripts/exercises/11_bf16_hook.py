"""Lesson 11, your turn: a communication hook that sends the gradients as bfloat16.

DDP calls a comm hook for each bucket of gradients instead of its own all_reduce (lesson 11,
"3 · Communication hooks"): `model.register_comm_hook(None, bf16_compress_hook)`. Write the
hook that torch ships as `default_hooks.bf16_compress_hook`: cast the bucket to bfloat16 and
divide it by the world size, all_reduce it without waiting (`async_op=True`), and when the sum
arrives, copy it back into the bucket in float32 and return the bucket. Half the bytes on the
wire, one rounding per gradient element: the check trains the same model with DDP's own
all_reduce beside yours, on 2 gloo ranks, and compares the gradients (within bf16's rounding)
and what your hook sent (its dtype and bytes).

Check it:

    ddp-tutorial check 11
"""

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
    # 1. a bfloat16 copy of `buffer`, divided by world_size (DDP averages; dividing before
    #    the sum keeps it in range)
    # 2. dist.all_reduce(that copy, group=group, async_op=True): a Work; its .get_future()
    #    completes when the sum has arrived
    # 3. future = that future.then(fn): fn receives it, takes the sum (.value()[0]), copies it
    #    into `buffer` (float32 again) and returns `buffer` (DDP would also cast a bfloat16
    #    result as it copies it into the bucket; the copy here makes the dtype explicit)
    # END YOUR CODE
    return future
