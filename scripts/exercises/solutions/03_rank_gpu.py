"""Lesson 03, a reference answer: this rank's device and physical GPU (see ../03_rank_gpu.py)."""

from collections.abc import Mapping

import torch


def rank_gpu(env: Mapping[str, str]) -> tuple[torch.device, int]:
    """(this rank's torch device, the physical GPU id behind it), from ``env``: a script passes
    os.environ, the check other ranks' environments - read ``env``, never os.environ."""
    device, physical = torch.device("cpu"), -1
    # YOUR CODE: the device from the right rank variable; the physical id from
    # CUDA_VISIBLE_DEVICES when it is set (env.get), else the same number.
    local_rank = int(env["LOCAL_RANK"])  # GPUs are numbered per node: never RANK
    device = torch.device("cuda", local_rank)  # a logical id: cuda:0 is the first card listed
    listed = env.get("CUDA_VISIBLE_DEVICES")
    physical = local_rank if listed is None else int(listed.split(",")[local_rank])
    # END YOUR CODE
    return device, physical
