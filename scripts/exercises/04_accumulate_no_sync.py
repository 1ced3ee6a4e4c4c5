"""Lesson 04, your turn: gradient accumulation under DDP, k micro-batches and one all_reduce.

A batch too large for memory is split into k micro-batches: run forward and backward on each,
let the gradients add up in ``.grad``, then step once. Under DDP every backward would
all-reduce; inside ``with model.no_sync():`` it sends nothing, and the first backward outside
it reduces the accumulated sum. Write the loop: all but the last micro-batch inside
``model.no_sync()``, each loss divided by k, so that the step equals one process's step on
the whole global batch, with exactly one all_reduce per step.

Check it (2 gloo ranks; the check counts the all_reduces and compares the weights with one
process trained on the global batch):

    ddp-tutorial check 04
"""

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # e.g. F.cross_entropy: a mean


def accumulation_step(
    model: DDP, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], loss_fn: LossFn
) -> None:
    """One optimizer step over k micro-batches: the step one process takes on all of them."""
    k = len(micro_batches)
    optimizer.zero_grad(set_to_none=True)
    # YOUR CODE: forward and backward for every (x, y); all but the last inside model.no_sync().
    # The loss of one micro-batch: loss_fn(model(x), y). The step must equal one on all of
    # THIS rank's micro-batches at once (DDP already averages over the ranks): the mean over
    # their samples. What must each micro-batch's loss be divided by?
    # Careful: DDP decides in the *forward* whether the backward after it will send.
    # END YOUR CODE
    optimizer.step()
