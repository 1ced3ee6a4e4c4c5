"""Lesson 01's exercises: wrong rings and wrong gathers, each named (edits of the solutions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from exercise_cases import BY_NAME, Case, assert_verdict, register

RING, GATHER = "01_ring_average", "01_gather_uneven"
ISEND = "        request = dist.isend(send_buf, dst=(rank + 1) % world)\n"
TRIM = "    result = [g[: int(n.item())] for g, n in zip(gathered, lengths, strict=True)]\n"
SOLUTION = Path(__file__).parents[1] / "scripts/exercises/solutions/01_ring_average.py"
RING_LOOP = SOLUTION.read_text().split("    total = tensor.clone()\n")[1].split("    # END")[0]
RING_LOOP = RING_LOOP[RING_LOOP.index("    send_buf, recv_buf") : RING_LOOP.index("    total /=")]
CHUNKED = (  # a bandwidth-optimal ring, reduce-scatter then all-gather, over chunk()
    "    chunks = list(total.chunk(world))  # views of total\n"
    "    right, left = (rank + 1) % world, (rank - 1) % world\n"
    "    for step in range(world - 1):  # reduce-scatter\n"
    "        s, r = (rank - step) % world, (rank - step - 1) % world\n"
    "        buf = torch.empty_like(chunks[r])\n"
    "        req = dist.isend(chunks[s].clone(), dst=right)\n"
    "        dist.recv(buf, src=left)\n"
    "        req.wait()\n"
    "        chunks[r] += buf\n"
    "    for step in range(world - 1):  # all-gather\n"
    "        s, r = (rank + 1 - step) % world, (rank - step) % world\n"
    "        buf = torch.empty_like(chunks[r])\n"
    "        req = dist.isend(chunks[s].clone(), dst=right)\n"
    "        dist.recv(buf, src=left)\n"
    "        req.wait()\n"
    "        chunks[r].copy_(buf)\n"
)
CASES = register([
    # helper 168: wrong answers that passed on the check's ranks, numbers or backend
    Case(RING, "three-ranks-written-in", "the ring's 3 ranks are written in",
         edits=(("    for _ in range(world - 1):\n", "    for _ in range(2):\n"),
                ("    total /= world", "    total /= 3"))),
    Case(RING, "recv-from-any-rank", "a recv without src= takes a message from any rank",
         edits=(("dist.recv(recv_buf, src=(rank - 1) % world)", "dist.recv(recv_buf)"),)),
    Case(RING, "buffer-cast-not-moved", "a tensor made without device=",
         edits=(("send_buf, recv_buf = tensor.clone(), torch.empty_like(tensor)",
                 "send_buf = tensor.clone()\n"
                 "    recv_buf = torch.zeros(tensor.shape).to(tensor.dtype)"),)),
    # helper 172: right, with a range(2) that is no ring of 2 steps
    Case(RING, "double-buffered", None,
         edits=(("    send_buf, recv_buf = tensor.clone(), torch.empty_like(tensor)\n",
                 "    bufs = [torch.empty_like(tensor) for _ in range(2)]  # send one, fill one\n"
                 "    bufs[0].copy_(tensor)\n"),
                ("    for _ in range(world - 1):\n",
                 "    for step in range(world - 1):\n"
                 "        send_buf, recv_buf = bufs[step % 2], bufs[(step + 1) % 2]\n"),
                ("        send_buf = recv_buf.clone()  # pass on what arrived: after world - 1 "
                 "steps, everyone's\n", ""))),
    Case(GATHER, "cut-by-a-pad-to-the-mean", "tensor lost its end (4 of 5 values)",  # h. 172
         edits=(("    longest = int(max(lengths).item())\n"
                 "    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)\n"
                 "    padded[: tensor.shape[0]] = tensor\n",
                 "    target = -(-int(sum(lengths).item()) // world)  # the mean, rounded up\n"
                 "    padded = F.pad(tensor, (0, target - tensor.shape[0]))\n"),
                ("import torch\n", "import torch\nimport torch.nn.functional as F\n"))),
    Case(GATHER, "two-ranks-written-in", "the number of ranks is written as 2",
         edits=(("    lengths = [torch.zeros_like(length) for _ in range(world)]",
                 "    lengths = [torch.zeros_like(length) for _ in range(2)]"),
                ("    gathered = [torch.empty_like(padded) for _ in range(world)]",
                 "    gathered = [torch.empty_like(padded) for _ in range(2)]"))),
    Case(GATHER, "padded-to-the-mean-rounded-up", "longer than its padding buffer",
         edits=(("    longest = int(max(lengths).item())",
                 "    longest = -(-int(sum(lengths).item()) // world)  # a sampler's share"),)),
    Case(GATHER, "cpu-lengths-beside-device-buffers", "a tensor made without device=",
         edits=(("torch.tensor([tensor.shape[0]], device=tensor.device)",
                 "torch.as_tensor([tensor.shape[0]])"),)),
    Case(GATHER, "cpu-outputs-appended", "a tensor made without device=",
         edits=(("    lengths = [torch.zeros_like(length) for _ in range(world)]",
                 "    lengths = []\n    for _ in range(world):\n"
                 "        lengths.append(torch.zeros(1, dtype=torch.long))"),)),
    Case(GATHER, "cpu-output-list", "a tensor made without device=",
         edits=(("    lengths = [torch.zeros_like(length) for _ in range(world)]",
                 "    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(world)]"),)),
    # from an eighth learner review: one output tensor for every rank ([t] * world)
    # helper 147: output buffers of this rank's own length (gloo's raw error before)
    Case(GATHER, "buffers-of-its-own-length", "the output list's tensors must have the shape",
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]",
                 "    gathered = [torch.empty_like(tensor) for _ in range(world)]"),)),
    Case(GATHER, "own-tensor-first", "in another order",
         edits=(("    # END YOUR CODE\n",
                 "    result = result[dist.get_rank() :] + result[: dist.get_rank()]\n"
                 "    # END YOUR CODE\n"),)),
    # helper 147: padding trimmed by value only at the end passed (no tensor ended in it)
    Case(GATHER, "trailing-zeros-stripped", "lost its 0s",
         edits=((TRIM, "    result = [g[: int(g.nonzero().max()) + 1] for g in gathered]\n"),)),
    # lesson 01's "nccl takes CUDA tensors only", which the reference answers broke too
    Case(GATHER, "lengths-made-on-the-cpu", "a tensor made without device=",
         edits=(("torch.tensor([tensor.shape[0]], device=tensor.device)",
                 "torch.tensor([tensor.shape[0]])"),)),
    Case(GATHER, "device-on-the-fourth-line", None,  # helper 166: a formatter's layout
         edits=(("torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "torch.zeros(\n        longest,\n        dtype=tensor.dtype,\n"
                 "        device=tensor.device,\n    )"),)),
    Case(GATHER, "trailing-minus-ones-stripped", "gather every rank's length first",
         edits=(("padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "padded = torch.full((longest,), -1, dtype=tensor.dtype)"),
                (TRIM, "    result = [g[: int((g != -1).nonzero().max()) + 1] for g in gathered]\n"))),  # noqa: E501
    Case(GATHER, "right-values-and-a-mask-in-one-block", None,  # helper 147: "sent 6 values"
         text="import torch\nimport torch.distributed as dist\n\n\ndef gather_uneven(tensor):\n"
              "    world = dist.get_world_size()\n    # YOUR CODE\n"
              "    longest = torch.tensor([tensor.numel()], device=tensor.device)\n"
              "    dist.all_reduce(longest, op=dist.ReduceOp.MAX)\n"
              "    block = torch.zeros(2, int(longest), dtype=tensor.dtype, device=tensor.device)\n"
              "    block[0, : tensor.numel()] = tensor\n"
              "    block[1, : tensor.numel()] = 1  # a mask: which slots are real\n"
              "    blocks = [torch.empty_like(block) for _ in range(world)]\n"
              "    dist.all_gather(blocks, block)\n"
              "    # END YOUR CODE\n    return [b[0][b[1] == 1] for b in blocks]\n"),
    Case(RING, "every-rank-receives-first", "every rank receives first, and nobody sends",
         edits=((ISEND, ""),
                ("        request.wait()\n",
                 "        dist.send(send_buf, dst=(rank + 1) % world)\n"))),
    Case(RING, "receives-from-where-it-sends", "receives from the rank it sends to",
         edits=(("src=(rank - 1) % world", "src=(rank + 1) % world"),)),
    Case(GATHER, "one-buffer-for-every-rank", "held one tensor several times",
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]",
                 "    gathered = [torch.empty_like(padded)] * world"),)),
    Case(RING, "blocking-sends", "waited",  # every rank sends first: nobody receives
         edits=((ISEND, "        dist.send(send_buf, dst=(rank + 1) % world)\n"),
                ("        request.wait()\n", ""))),
    Case(RING, "the-sum", "divide by the world size",
         edits=(("    total /= world  # the mean\n", ""),)),
    Case(RING, "all-reduce", "called dist.all_reduce",
         text="import torch.distributed as dist\n\n\ndef ring_average(tensor):\n"
              "    # YOUR CODE\n    dist.all_reduce(tensor)\n    # END YOUR CODE\n"
              "    return tensor / dist.get_world_size()\n"),
    Case(RING, "all-reduce-imported-by-name", "called dist.all_reduce",
         text=BY_NAME[1] + "\n\n"
              "def ring_average(tensor):\n    # YOUR CODE\n    all_reduce(tensor)\n"
              "    # END YOUR CODE\n    return tensor / dist.get_world_size()\n"),
    Case(GATHER, "left-padded", "still has its padding",
         edits=((TRIM, "    result = gathered\n"),)),
    Case(GATHER, "own-length", "trim each to its own",
         edits=((TRIM, "    result = [g[: tensor.shape[0]] for g in gathered]\n"),)),
    Case(GATHER, "unpadded", "every rank must send the same shape",  # gloo aborts a rank
         text="import torch\nimport torch.distributed as dist\n\n\ndef gather_uneven(tensor):\n"
              "    # YOUR CODE\n    out = [torch.empty_like(tensor) for _ in range(2)]\n"
              "    dist.all_gather(out, tensor)\n    # END YOUR CODE\n    return out\n"),
    Case(RING, "divided-at-every-step", "divide once, after the last step",
         edits=(("    total /= world  # the mean\n", ""),
                ("        total += recv_buf\n",
                 "        total += recv_buf\n        total /= world\n"))),
    Case(GATHER, "float-padding", "came back as float32",
         edits=(("padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "padded = torch.zeros(longest)"),)),
    Case(RING, "left-neighbour-negative", "is not a rank",
         edits=(("src=(rank - 1) % world", "src=rank - 1"),)),
    Case(RING, "receives-into-the-buffer-being-sent", "receive into a buffer of its own",
         edits=(("dist.recv(recv_buf, src=", "dist.recv(send_buf, src="),
                ("        total += recv_buf\n", "        total += send_buf\n"),
                ("        send_buf = recv_buf.clone()", "        pass"))),
    Case(RING, "batch-isend-irecv", None,  # a right answer, torch's own ring example
         edits=(("        request = dist.isend(send_buf, dst=(rank + 1) % world)\n"
                 "        dist.recv(recv_buf, src=(rank - 1) % world)\n"
                 "        request.wait()\n",
                 "        ops = [dist.P2POp(dist.isend, send_buf, (rank + 1) % world),\n"
                 "               dist.P2POp(dist.irecv, recv_buf, (rank - 1) % world)]\n"
                 "        for request in dist.batch_isend_irecv(ops):\n"
                 "            request.wait()\n"),)),
    # helper 118: a receive read before its wait failed on a busy host only, and the verdict
    # blamed the sum ("pass on what you received"); on an idle one the race may pass
    Case(RING, "irecv-read-before-its-wait", "read the tensor of a dist.irecv before its .wait()",
         edits=(("        dist.recv(recv_buf, src=(rank - 1) % world)\n"
                 "        request.wait()\n        total += recv_buf\n",
                 "        received = dist.irecv(recv_buf, src=(rank - 1) % world)\n"
                 "        total += recv_buf\n        request.wait()\n"
                 "        received.wait()\n"),)),
    Case(RING, "irecv-waited-then-read", None,  # right: the wait comes before the read
         edits=(("        dist.recv(recv_buf, src=(rank - 1) % world)\n",
                 "        received = dist.irecv(recv_buf, src=(rank - 1) % world)\n"
                 "        received.wait()\n"),)),
    # from a learner review
    Case(RING, "floor-division", "`//` is floor division",
         edits=(("    total /= world  # the mean\n", "    total //= world\n"),)),
    Case(RING, "isend-work-dropped", "let go of before its wait()",
         edits=((ISEND, "        dist.isend(send_buf, dst=(rank + 1) % world)\n"),
                ("        request.wait()\n", ""),
                ("        send_buf = recv_buf.clone()", "        send_buf, recv_buf = recv_buf, "
                 "torch.empty_like(tensor)"))),
    # session 30: the verdict pointed at the checker's line, not at the isend let go of
    Case(RING, "isend-dropped-irecv-waited", "(your file, line",
         edits=((ISEND, "        dist.isend(send_buf, dst=(rank + 1) % world)\n"),
                ("        dist.recv(recv_buf, src=(rank - 1) % world)\n        request.wait()\n",
                 "        dist.irecv(recv_buf, src=(rank - 1) % world).wait()\n"))),
    # helper 158: passed on the check's data (3 values on 3 ranks, int64 inputs only)
    Case(RING, "chunked-by-the-world-size", "",
         edits=((RING_LOOP, CHUNKED),)),
    Case(GATHER, "padding-buffer-of-int64-always", "padding buffer with the input's dtype",
         edits=(("torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "torch.zeros(longest, dtype=torch.long)"),)),
    Case(GATHER, "padded-with-minus-one-trimmed-by-value", "trim by the lengths gathered",
         edits=(("padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "padded = torch.full((longest,), -1, dtype=tensor.dtype)"),
                (TRIM, "    result = [g[g != -1] for g in gathered]\n"))),
    Case(GATHER, "rank-0s-length-for-all", "",
         edits=(("longest = int(max(lengths).item())", "longest = int(lengths[0].item())"),)),
    Case(GATHER, "broadcasts-not-all-gather", "not one broadcast per rank",
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
                 "    dist.all_gather(gathered, padded)\n",
                 "    gathered = [padded.clone() if r == dist.get_rank() else torch.empty_like("
                 "padded) for r in range(world)]\n"
                 "    for r in range(world):\n        dist.broadcast(gathered[r], src=r)\n"),)),
    # helper 70: on 3 ranks both others are neighbours, and a star or an exchange with
    # everyone passed as a ring
    Case(RING, "a-star-through-rank-0", "in a ring each rank sends to one neighbour",
         edits=((RING_LOOP, "    if rank == 0:\n        for src in range(1, world):\n"
                 "            buf = torch.empty_like(tensor)\n"
                 "            dist.recv(buf, src=src)\n            total += buf\n"
                 "        for dst in range(1, world):\n            dist.send(total, dst=dst)\n"
                 "    else:\n        dist.send(tensor, dst=0)\n"
                 "        dist.recv(total, src=0)\n"),)),
    Case(RING, "an-exchange-with-everyone", "in a ring each rank sends to one neighbour",
         edits=((RING_LOOP, "    for peer in range(world):\n        if peer != rank:\n"
                 "            request = dist.isend(tensor, dst=peer)\n"
                 "            buf = torch.empty_like(tensor)\n"
                 "            dist.recv(buf, src=peer)\n            request.wait()\n"
                 "            total += buf\n"),)),
    Case(GATHER, "padded-with-zero-trimmed-by-value", "lost its 0s",
         edits=((TRIM, "    result = [g[g != 0] for g in gathered]\n"),)),
    # from a third learner review
    Case(RING, "send-buffer-refilled-before-the-wait", "changed the tensor of an isend",
         edits=(("        request.wait()\n        total += recv_buf\n"
                 "        send_buf = recv_buf.clone()",
                 "        total += recv_buf\n        send_buf.copy_(recv_buf)\n"
                 "        request.wait()"),)),
    Case(RING, "received-into-the-tensor-being-sent", "received into the tensor an isend is",
         edits=(("        send_buf = recv_buf.clone()", "        send_buf = recv_buf"),)),
    Case(GATHER, "values-as-a-list-through-all-gather-object", "all_gather_object sent a list",
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
                 "    dist.all_gather(gathered, padded)\n",
                 "    objects = [None] * world\n"
                 "    dist.all_gather_object(objects, padded.tolist())\n"
                 "    gathered = [torch.tensor(o, dtype=tensor.dtype) for o in objects]\n"),)),
    Case(GATHER, "tensors-through-all-gather-object", "all_gather_object sent a Tensor",
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
                 "    dist.all_gather(gathered, padded)\n",
                 "    gathered = [None] * world\n"
                 "    dist.all_gather_object(gathered, padded)\n"),)),
    Case(GATHER, "lengths-with-all-gather-object", None,  # right: a few ints may go that way
         edits=(("    lengths = [torch.zeros_like(length) for _ in range(world)]\n"
                 "    dist.all_gather(lengths, length)\n",
                 "    lengths = [None] * world\n"
                 "    dist.all_gather_object(lengths, tensor.shape[0])\n"
                 "    lengths = [torch.tensor(n) for n in lengths]\n"),)),
    # from a twenty-fifth-session review: a fixed padding passed while every tensor fitted
    Case(GATHER, "padded-to-a-fixed-64", "pad to the longest length gathered",
         edits=(("padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "padded = torch.zeros(64, dtype=tensor.dtype)"),)),
    Case(GATHER, "flat-buffer-padded-to-a-fixed-64", "not to a fixed size",
         edits=(("padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)",
                 "longest = 64\n    padded = torch.zeros(longest, dtype=tensor.dtype)"),
                ("    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
                 "    dist.all_gather(gathered, padded)\n",
                 "    flat = torch.empty(world * longest, dtype=tensor.dtype,\n"
                 "                       device=tensor.device)\n"
                 "    dist.all_gather_into_tensor(flat, padded)\n"
                 "    gathered = list(flat.split(longest))\n"),)),
    Case(GATHER, "all-gather-into-tensor", None,  # right: one collective, one flat buffer
         edits=(("    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
                 "    dist.all_gather(gathered, padded)\n",
                 "    flat = torch.empty(world * longest, dtype=tensor.dtype,\n"
                 "                       device=tensor.device)\n"
                 "    dist.all_gather_into_tensor(flat, padded)\n"
                 "    gathered = list(flat.split(longest))\n"),)),
    # helper 129: a right answer failed ("a fixed size"), three wrong rings got the generic
    # message
    Case(GATHER, "length-in-slot-0", None, text=(
        "import torch\nimport torch.distributed as dist\n\n\n"
        "def gather_uneven(tensor: torch.Tensor) -> list[torch.Tensor]:\n"
        "    world = dist.get_world_size()\n"
        "    longest = torch.tensor(tensor.numel(), device=tensor.device)\n"
        "    dist.all_reduce(longest, op=dist.ReduceOp.MAX)\n"
        "    padded = torch.zeros(int(longest) + 1, dtype=tensor.dtype, device=tensor.device)\n"
        "    padded[0] = tensor.numel()  # the length travels with the data\n"
        "    padded[1 : tensor.numel() + 1] = tensor\n"
        "    gathered = [torch.empty_like(padded) for _ in range(world)]\n"
        "    dist.all_gather(gathered, padded)\n"
        "    return [g[1 : 1 + int(g[0])] for g in gathered]\n")),
    Case(RING, "divided-by-world-minus-1", "divided by world_size - 1",
         edits=(("    total /= world", "    total /= world - 1"),)),
    Case(RING, "one-step-too-many", "added its own tensor twice",
         edits=(("for _ in range(world - 1):", "for _ in range(world):"),)),
    Case(RING, "passes-on-the-running-total", "passed on its running total",
         edits=(("send_buf = recv_buf.clone()", "send_buf = total.clone()"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_collectives_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)


def test_a_tensor_made_on_the_cpu_for_a_collective_is_told_apart():
    """Lesson 01's "nccl takes CUDA tensors only", as the checks read a passing answer: a tensor
    made without device= that a collective later takes, not one made with it (on one line or
    spread over three, as a formatter writes it), nor one no collective takes."""
    import re

    from ddp_tutorial.exercises.core import COPY_IN_A_COLLECTIVE, MADE_ON_THE_CPU, find

    pattern = MADE_ON_THE_CPU[0]
    wrong = [
        "    n = torch.tensor([3])\n    dist.all_gather(out, n)\n",
        "    buf = torch.zeros(total)\n    x = 1\n    dist.all_reduce(buf)\n",
        # helper 168: a dtype is not a device; a device= on a line between; a list of them
        "    buf = torch.zeros(t.shape).to(t.dtype)\n    dist.recv(buf, src=1)\n",
        "    n = torch.tensor([3])\n    out = [torch.zeros(1, device=t.device)]\n"
        "    dist.all_gather(out, n)\n",
        "    out = [torch.zeros(1, dtype=torch.long) for _ in range(w)]\n"
        "    dist.all_gather(out, n)\n",
        "    n = torch.as_tensor([t.numel()])\n    dist.all_gather(out, n)\n",
        # helper 171: the legacy constructor; a copy on the CPU
        "    buf = torch.Tensor(p.grad.numel())\n    dist.all_reduce(buf)\n",
        "    g = p.grad.cpu()\n    dist.all_reduce(g)\n",
        "    n = torch.tensor(float(sum(len(y) for _, y in mb)))\n    dist.all_reduce(n)\n",
        # a list of outputs filled by .append (unseen before), by += [...] (helper 177)
        "    out = []\n    for _ in range(w):\n        out += [torch.zeros(1)]\n"
        "    dist.all_gather(out, n)\n",
        "    out = []\n    for _ in range(w):\n        out.append(torch.zeros(1))\n"
        "    dist.all_gather(out, n)\n",
    ]
    right = ["    n = torch.tensor([3], device=t.device)\n    dist.all_gather(out, n)\n",
             "    n = torch.tensor(\n        [3],\n        device=t.device,\n    )\n"
             "    dist.all_gather(out, n)\n",
             "    n = torch.tensor([3])\n    print(n)\n",
             "    n = torch.tensor([3]).to(t)\n    dist.all_gather(out, n)\n",
             "    n = torch.tensor([3])\n    n = n.cuda()\n    dist.all_gather(out, n)\n",
             "    with torch.device(t.device):\n        n = torch.tensor([3])\n"
             "    dist.all_gather(out, n)\n",
             "    out = [torch.zeros_like(n) for _ in range(w)]\n    dist.all_gather(out, n)\n",
             "    buf = torch.zeros(n, dtype=torch.float32).to(dev)\n"
             "    dist.all_reduce(buf)\n",
             # helper 172: a dtype and a device in one .to(); as_tensor of a tensor keeps its
             # device; a range(2) that is no ring of 2 steps (the ring's own rule)
             "    n = torch.tensor([3]).to(dtype=torch.int64, device=t.device)\n"
             "    dist.all_gather(out, n)\n",
             "    c = torch.as_tensor(buffer, dtype=torch.bfloat16)\n"
             "    dist.all_reduce(c)\n",
             "    out = []\n    for _ in range(w):\n"
             "        out.append(torch.zeros(1, device=n.device))\n"
             "    dist.all_gather(out, n)\n",
             "    out = []\n    for _ in range(w):\n        out.append(torch.zeros_like(n))\n"
             "    dist.all_gather(out, n)\n",
             # helper 174: type_as takes the other tensor's device as well as its dtype
             "    c = torch.zeros(3, k).type_as(pred)\n    dist.all_reduce(c)\n"]  # fmt: skip
    assert all(re.search(pattern, text) for text in wrong)
    assert not any(re.search(pattern, text) for text in right)
    # a CPU copy handed to the collective itself: its result is thrown away on a GPU
    copy = COPY_IN_A_COLLECTIVE[0]
    assert re.search(copy, "    dist.all_reduce(sums.cpu())\n")
    assert re.search(copy, "    dist.all_gather(out, x.to('cpu'))\n")
    assert re.search(copy, "    dist.all_reduce(sums.detach().cpu())\n")
    assert re.search(copy, "    dist.all_reduce(tensor=sums.cpu())\n")
    assert not re.search(copy, "    dist.all_reduce(sums)\n    total = sums.cpu()\n")
    assert not re.search(copy, "    dist.all_gather_object(out, sums.cpu())\n")  # pickled
    assert not re.search(copy, "    dist.all_gather(out, sums.cpu().tolist())\n")
    (gather,) = find("01_gather_uneven")
    (snapshot,) = find("05_atomic_snapshot")  # a function that gets no tensor to place its own
    assert MADE_ON_THE_CPU in gather.tried_on_a_pass
    assert COPY_IN_A_COLLECTIVE in gather.tried_on_a_pass
    assert MADE_ON_THE_CPU not in find("09_find_the_hang")[0].tried_on_a_pass  # a gloo script
    assert snapshot.kind == "functions"
