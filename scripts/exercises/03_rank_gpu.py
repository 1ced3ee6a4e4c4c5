"""Lesson 03, your turn: which GPU is this rank's?

A rank reads its numbers from the environment torchrun gives it: ``RANK`` (unique in the
whole job) and ``LOCAL_RANK`` (its index on this node). GPUs are numbered per node, so the
device is ``cuda:LOCAL_RANK``. If the launcher set ``CUDA_VISIBLE_DEVICES``, the process sees
only the listed cards, renumbered from 0 in the order written: with ``"5,6,7"``, ``cuda:1``
is the card ``nvidia-smi`` calls 6. Return both: the torch device this rank must use, and the
physical id of the card behind it (``CUDA_VISIBLE_DEVICES`` holds plain ids here; spaces are
allowed, as CUDA skips them). Build the device without touching CUDA: no ``torch.cuda`` call.

Check it (2 gloo ranks; the check calls your function with the environments of ranks on one-
and two-node GPU jobs):

    ddp-tutorial check 03
"""

from collections.abc import Mapping

import torch


def rank_gpu(env: Mapping[str, str]) -> tuple[torch.device, int]:
    """(this rank's torch device, the physical GPU id behind it), from ``env``: a script passes
    os.environ, the check other ranks' environments - read ``env``, never os.environ."""
    device, physical = torch.device("cpu"), -1
    # YOUR CODE: the device from the right rank variable; the physical id from
    # CUDA_VISIBLE_DEVICES when it is set (env.get), else the same number.
    # END YOUR CODE
    return device, physical
