"""Lesson 12, your turn (2 of 2): your own DDP, bucketed, overlapping communication with backward.

Exercise 1 sent every gradient on its own and made backward wait for each. DDP's reducer does
better (lesson 04, "Gradients are averaged, bucket by bucket"; lesson 11, "Overlap, seen"): it
groups the parameters into **buckets** of about ``bucket_cap_bytes``, in the order backward
produces their gradients - unknown before the first backward, so it guesses: the reverse of the
order the model registered them (the last layer's first) - and, from a hook, launches one
all_reduce per bucket as soon as the bucket's last gradient is ready, **asynchronously**
(``async_op=True``), so that the earlier layers' gradients are computed while the later ones
travel. Nothing is waited on until ``finish_gradient_sync()``, which the training loop calls
after ``loss.backward()`` and before ``optimizer.step()``: there each bucket is waited on,
divided by the world size and copied back into its parameters' ``.grad``.

Your buckets follow that guess (the check reads them as your constructor built them), which
holds when the layers run in the order they are defined. The check's MLP defines its layers out
of the order it runs them, so the order its buckets fill cannot be read from their list (DDP
records the order the gradients came in its first step and rebuilds its buckets in it; yours
need not). Count each bucket's own gradients, and keep each Work with the bucket it came from.

A tensor you make for a collective goes on the device of the ones you are given
(device=x.device): gloo takes CPU tensors, nccl CUDA ones only (lesson 01, "Backends:
gloo and nccl"), and the check reads your lines for it.

Check it (2 gloo ranks; 3 buckets for the check's MLP; your 4 SGD steps are compared with
DistributedDataParallel's, your all_reduce calls and waits are recorded, and your step is
timed against DDP's):

    ddp-tutorial check 12
"""

import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP:
    """Averages ``model``'s gradients over the ranks the way DDP's reducer does.

    The loop: ``loss.backward(); ddp.finish_gradient_sync(); optimizer.step()``.
    """

    def __init__(self, model: nn.Module, bucket_cap_bytes: int) -> None:
        self.model = model
        self.world_size = dist.get_world_size()
        self.buckets: list[list[nn.Parameter]] = []  # each: the parameters sent together
        self.bucket_of: dict[nn.Parameter, int] = {}  # parameter -> index of its bucket
        self.pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []  # sent
        # YOUR CODE 1: rank 0's weights on every rank, as in exercise 1 (12_my_ddp_hooks).
        # END YOUR CODE
        # YOUR CODE 2: fill self.buckets and self.bucket_of. Walk list(model.parameters()) in
        # REVERSE; add each to the current bucket and count its bytes (p.numel() *
        # p.element_size()); once the bucket holds >= bucket_cap_bytes, close it and start a
        # new one; at the end, close the last one if it holds anything.
        # END YOUR CODE
        self.ready = [0] * len(self.buckets)  # per bucket: its gradients ready in this backward
        # YOUR CODE 3: on every parameter, p.register_post_accumulate_grad_hook(self._grad_ready)
        # END YOUR CODE

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this as soon as ``param.grad`` holds this backward's gradient."""
        # YOUR CODE 4: count param as ready in its bucket; when that was the bucket's last
        # gradient, launch the bucket: self._launch(its index).
        # END YOUR CODE

    def _launch(self, i: int) -> None:
        """Start bucket ``i``'s all_reduce, without waiting for it."""
        # YOUR CODE 5: flatten the bucket's gradients into one tensor (torch.cat of each
        # p.grad.flatten()), all_reduce it with async_op=True (a Work comes back: do not wait
        # on it here, backward is still running); keep (work, flat, the bucket) in self.pending.
        # END YOUR CODE

    def finish_gradient_sync(self) -> None:
        """After ``loss.backward()``, before ``optimizer.step()``: every p.grad, averaged."""
        # YOUR CODE 6: for each pending (work, flat, params): work.wait(), divide flat by the
        # world size, copy its pieces back into each p.grad (p.grad.copy_(piece.view_as(p))).
        # Then empty self.pending and reset the ready counts for the next step.
        # END YOUR CODE
