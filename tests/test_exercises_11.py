"""Lesson 11's exercises: wrong mixed-precision steps and bf16 hooks, each named (edits of the
solutions)."""

from __future__ import annotations

import pytest
from exercise_cases import BY_NAME, Case, assert_verdict, register

EX = "11_bf16_hook"
AMP = "11_amp_step"
CASES = register([
    # helper 169: wrong answers that passed (the check's own group handed as the state; one
    # bucket layout) or were told "copy the sum back" (a division while the sum was in flight)
    Case(EX, "size-of-the-state", "register_comm_hook(None, hook), the hook raised AttributeError",
         edits=(("    world_size = dist.get_world_size(group)\n",
                 "    world_size = process_group.size()\n"),)),
    Case(EX, "send-buffer-kept-per-bucket-index", "a bucket came with another size than before",
         edits=(("    compressed = buffer.to(torch.bfloat16).div_(world_size)",
                 "    compressed = SENT.setdefault(bucket.index(), torch.empty(buffer.numel(), "
                 "dtype=torch.bfloat16))\n    compressed.copy_(buffer).div_(world_size)"),
                ("def bf16_compress_hook(", "SENT = {}\n\n\ndef bf16_compress_hook("))),
    Case(EX, "divided-while-in-flight", "changed the tensor of its all_reduce while the sum",
         edits=(("    compressed = buffer.to(torch.bfloat16).div_(world_size)",
                 "    compressed = buffer.to(torch.bfloat16)"),
                ("    work = dist.all_reduce(compressed, group=group, async_op=True)\n",
                 "    work = dist.all_reduce(compressed, group=group, async_op=True)\n"
                 "    compressed.div_(world_size)\n"))),
    # helper 72: a scaled loss returned (and logged) passed, backward under autocast passed,
    # and a hook that cast DDP's own bucket (buffer.data = ...) passed
    # from a twenty-fifth-session learner review (helper 127)
    Case(AMP, "bf16-backward-unscaled-but-scaler-step", "in every dtype",
         edits=(("to_backward = scaler.scale(loss)",
                 "to_backward = loss if dtype == torch.bfloat16 else scaler.scale(loss)"),)),
    Case(AMP, "bf16-without-the-scaler", "in bfloat16 too",
         edits=(("to_backward = scaler.scale(loss)",
                 "to_backward = loss if dtype == torch.bfloat16 else scaler.scale(loss)"),
                ("    scaler.step(optimizer)  #", "    if dtype == torch.bfloat16:\n"
                 "        optimizer.step()\n    else:\n        scaler.step(optimizer)  #"),
                ("    scaler.update()  #", "        scaler.update()  #"))),
    # helper 142: the step under `if rank == 0` - rank 1's scaler then has nothing to update
    Case(AMP, "step-on-rank-0-only", "under `if rank == 0`",
         edits=(("    scaler.step(optimizer)  #",
                 "    if torch.distributed.get_rank() == 0:\n        scaler.step(optimizer)  #"),)),
    Case(AMP, "update-only-in-float16", "call scaler.update() after every scaler.step",
         edits=(("    scaler.update()  #",
                 "    if dtype == torch.float16:\n        scaler.update()  #"),)),
    # helper 136: the YOUR CODE markers deleted hid the learner's lines from the patterns
    Case(EX, "default-group-markers-deleted", "the hook uses the default group",
         edits=(("    # YOUR CODE: compress", "    # compress"), ("    # END YOUR CODE\n", ""),
                ("dist.all_reduce(compressed, group=group, async_op=True)",
                 "dist.all_reduce(compressed, async_op=True)"))),
    # helper 142: the group judged by a regex over the call's text missed a multi-line call and
    # refused a right one (the group passed by position; a cast inside the call's brackets)
    Case(EX, "default-group-over-several-lines", "the hook uses the default group",
         edits=(("dist.all_reduce(compressed, group=group, async_op=True)",
                 "dist.all_reduce(\n        compressed,\n        async_op=True,\n    )"),)),
    Case(EX, "group-by-position", None,
         edits=(("dist.all_reduce(compressed, group=group, async_op=True)",
                 "dist.all_reduce(compressed, dist.ReduceOp.SUM, group, True)"),)),
    Case(EX, "cast-inside-the-call", None,
         edits=(("    compressed = buffer.to(torch.bfloat16).div_(world_size)  # divide first: "
                 "DDP averages\n", ""),
                ("dist.all_reduce(compressed, group=group, async_op=True)",
                 "dist.all_reduce(buffer.to(torch.bfloat16).div_(world_size), group=group, "
                 "async_op=True)"))),
    Case(EX, "then-returns-the-list", "returned f.value(), a list [tensor]",
         edits=(("    future = work.get_future().then(decompress)\n",
                 "    future = work.get_future().then(lambda f: f.value())\n"),)),
    # helper 162: told "float16 rounding" (the step was 1/1024), and "not updated" (unscale_
    # after the step)
    Case(AMP, "scaled-loss-not-kept", "backward ran on the unscaled loss",
         edits=(("            to_backward = scaler.scale(loss)  # fp16: small gradients stay "
                 "above 0\n", "            scaler.scale(loss)\n"),)),
    Case(AMP, "unscale-after-the-step", "ran after a scaler.step(optimizer)",
         edits=(("    scaler.update()  # after a skip: the scale halves\n",
                 "    scaler.unscale_(optimizer)\n"
                 "    scaler.update()  # after a skip: the scale halves\n"),)),
    # torch's own hook called from the learner's: it passed (the exercise is writing it)
    Case(EX, "torchs-own-hook-called", "torch's own hook did the work",
         edits=(("import torch.distributed as dist\n", "import torch.distributed as dist\n"
                 "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"),
                ("    compressed = buffer.to(torch.bfloat16).div_(world_size)  # divide first: "
                 "DDP averages\n", ""),
                ("    work = dist.all_reduce(compressed, group=group, async_op=True)\n", ""),
                ("    future = work.get_future().then(decompress)\n",
                 "    future = default_hooks.bf16_compress_hook(group, bucket)\n"))),
    Case(EX, "hook-on-the-default-group", "the hook uses the default group",
         edits=(("dist.all_reduce(compressed, group=group, async_op=True)",
                 "dist.all_reduce(compressed, async_op=True)"),)),
    Case(AMP, "scaled-loss-returned", "the loss times the scale",
         edits=(("            to_backward = scaler.scale(loss)  # fp16: small gradients stay "
                 "above 0\n", "            loss = scaler.scale(loss)\n"
                 "            to_backward = loss\n"),)),
    Case(AMP, "a-made-up-loss-returned", "the step's loss is",
         edits=(("    return total", "    return 12345.0"),)),
    Case(AMP, "backward-under-autocast", "backward() ran inside torch.autocast",
         edits=(("            to_backward.backward()\n",
                 "            with torch.autocast(x.device.type, dtype=dtype):\n"
                 "                to_backward.backward()\n"),)),
    Case(EX, "bucket-cast-in-place", "changed the bucket's own tensor",
         edits=(("    compressed = buffer.to(torch.bfloat16).div_(world_size)  # divide first: "
                 "DDP averages\n", "    buffer.data = buffer.to(torch.bfloat16) / world_size\n"
                 "    compressed = buffer\n"),)),
    Case(AMP, "all-reduce-every-micro-batch", "model.no_sync()",
         edits=(("sync = nullcontext() if last else model.no_sync()", "sync = nullcontext()"),)),
    Case(AMP, "no-autocast", "torch.autocast",
         edits=(("cast = torch.autocast(x.device.type, dtype=dtype)", "cast = nullcontext()"),)),
    Case(AMP, "backward-on-the-unscaled-loss", "scaler.scale(loss)",
         edits=(("to_backward = scaler.scale(loss)", "to_backward = loss"),)),
    Case(AMP, "optimizer-step-past-the-scaler", "not optimizer.step()",
         edits=(("    scaler.step(optimizer)", "    optimizer.step()"),)),
    Case(AMP, "optimizer-step-no-scaler", "step through the scaler",
         edits=(("    scaler.step(optimizer)", "    optimizer.step()"),
                ("    scaler.update()  # after a skip: the scale halves\n", ""))),
    Case(AMP, "step-every-micro-batch", "one scaler.step, after the last micro-batch",
         edits=(("        total += loss.item()\n",
                 "        total += loss.item()\n        scaler.step(optimizer)\n"
                 "        scaler.update()\n"),
                ("    scaler.step(optimizer)  # unscales", "    # unscales"),
                ("    scaler.update()  # after a skip: the scale halves\n", ""))),
    Case(AMP, "no-update", "call scaler.update() after every scaler.step",
         edits=(("    scaler.update()  # after a skip: the scale halves\n", ""),)),
    Case(AMP, "loss-not-divided", "divide each micro-batch's loss",
         edits=(("loss = nn.functional.cross_entropy(model(x), y) / accum",
                 "loss = nn.functional.cross_entropy(model(x), y)"),)),
    Case(AMP, "no-sync-on-the-last-micro-batch", "not the last: model.no_sync()",
         edits=(("sync = nullcontext() if last else model.no_sync()",
                 "sync = model.no_sync() if last else nullcontext()"),)),
    # from a learner review: each named for what it is
    Case(AMP, "scale-never-halves", "the scale did not halve",
         edits=(("    scaler.update()  #", "    scaler.update(scaler.get_scale())  #"),)),
    Case(AMP, "loss-divided-by-the-world-size-too", "divided once too often",
         edits=(("            to_backward = scaler.scale(loss)",
                 "            to_backward = scaler.scale(loss / 2)"),)),
    # from a seventh learner review: each named for what it is, not for float16's rounding
    Case(AMP, "loss-divided-by-accum-twice", "divided by accum twice",
         edits=(("scaler.scale(loss)  #", "scaler.scale(loss / accum)  #"),)),
    Case(AMP, "loss-divided-by-len-x", "divided by len(x) too",
         edits=(("scaler.scale(loss)  #", "scaler.scale(loss / len(x))  #"),)),
    Case(AMP, "clipped-without-unscale", "scaler.unscale_(optimizer) before clipping",
         edits=(("    scaler.step(optimizer)  #",
                 "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                 "    scaler.step(optimizer)  #"),)),
    Case(AMP, "clipped-after-unscale", None,  # right
         edits=(("    scaler.step(optimizer)  #",
                 "    scaler.unscale_(optimizer)\n"
                 "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)\n"
                 "    scaler.step(optimizer)  #"),)),
    Case(AMP, "update-before-step", "found no scaler.step(optimizer) before it",
         edits=(("    scaler.step(optimizer)  # unscales; skips the step on every rank if a "
                 "gradient is inf/nan\n", ""),
                ("    scaler.update()  # after a skip: the scale halves\n",
                 "    scaler.update()\n    scaler.step(optimizer)\n"))),
    Case(AMP, "loss-times-the-scale", "did not run on scaler.scale(loss)",
         edits=(("to_backward = scaler.scale(loss)", "to_backward = loss * scaler.get_scale()"),)),
    # from a sixth learner review: answers fitted to one call
    Case(AMP, "no-sync-on-the-first-only", "all but the last run under model.no_sync()",
         edits=(("        sync = nullcontext() if last else model.no_sync()",
                 "        sync = model.no_sync() if i == 0 else nullcontext()"),)),
    Case(AMP, "float16-whatever-the-dtype", "not in the bfloat16 asked for",
         edits=(("torch.autocast(x.device.type, dtype=dtype)",
                 "torch.autocast(x.device.type, dtype=torch.float16)"),)),
    Case(EX, "future-not-chained", "whose value is a list [tensor]",
         edits=(("    future = work.get_future().then(decompress)",
                 "    future = work.get_future()"),)),
    Case(EX, "sum-not-mean", "divide by the world size",
         edits=((".div_(world_size)", ""),)),
    Case(EX, "sends-float32", "cast the bucket to torch.bfloat16",
         edits=(("buffer.to(torch.bfloat16)", "buffer.clone()"),)),
    Case(EX, "sum-never-returned", "copy the all-reduced sum back into the bucket",
         edits=(("    future = work.get_future().then(decompress)\n",
                 "    work.wait()\n"),)),
    Case(EX, "string-annotations", "DDP refused the hook's signature",
         edits=(("DDP reads the hook's annotations at run time.\n",
                 "DDP reads the hook's annotations at run time.\n"
                 "from __future__ import annotations\n\n"),)),
    Case(EX, "sends-float16", "sent float16",
         edits=(("buffer.to(torch.bfloat16)", "buffer.to(torch.float16)"),)),
    Case(EX, "blocking-all-reduce", "waited for its all_reduce (no async_op=True)",
         edits=(("    work = dist.all_reduce(compressed, group=group, async_op=True)\n",
                 "    dist.all_reduce(compressed, group=group)\n    buffer.copy_(compressed)\n"),
                ("    future = work.get_future().then(decompress)\n", ""))),
    Case(EX, "blocking-all-reduce-imported-by-name", "waited for its all_reduce",
         edits=(BY_NAME,
                ("    work = dist.all_reduce(compressed, group=group, async_op=True)\n",
                 "    all_reduce(compressed, group=group)\n    buffer.copy_(compressed)\n"),
                ("    future = work.get_future().then(decompress)\n", ""))),
    Case(EX, "then-returns-none", "returned None",
         edits=(("        return buffer\n", ""),)),
    Case(EX, "divided-twice", "divided them twice",
         edits=(("buffer.copy_(done.value()[0])", "buffer.copy_(done.value()[0] / world_size)"),)),
    Case(EX, "one-all-reduce-per-gradient", "one per bucket",
         edits=(("    compressed = buffer.to(torch.bfloat16).div_(world_size)  #",
                 "    sent = [g.to(torch.bfloat16).div_(world_size) for g in bucket.gradients()]\n"
                 "    works = [dist.all_reduce(t, group=group, async_op=True) for t in sent]\n"
                 "    compressed = buffer.to(torch.bfloat16).div_(world_size)  #"),
                ("    work = dist.all_reduce(compressed, group=group, async_op=True)\n", ""),
                ("        buffer.copy_(done.value()[0])",
                 "        buffer.copy_(torch.cat([t.reshape(-1) for t in sent]))"),
                ("    future = work.get_future().then(decompress)",
                 "    future = torch.futures.collect_all([w.get_future() for w in works])"
                 ".then(decompress)"))),
    # from a learner review: waits inside the hook passed as "asynchronously"
    Case(EX, "work-waited-then-copied-into-the-placeholder", "the hook waited inside",
         edits=(("    future = work.get_future().then(decompress)\n",
                 "    work.wait()\n    buffer.copy_(compressed)\n"),)),
    Case(EX, "future-waited-inside-the-hook", "the hook waited inside",
         edits=(("    future = work.get_future().then(decompress)\n",
                 "    future = work.get_future().then(decompress)\n    future.wait()\n"),)),
    # helper 99: right on the check's CPU, no mixed precision on a GPU; the check's 2 ranks
    Case(AMP, "autocast-on-the-cpu-only", "casts only what runs on the CPU",
         edits=(("torch.autocast(x.device.type, dtype=dtype)",
                 'torch.autocast("cpu", dtype=dtype)'),)),
    Case(EX, "divided-by-two-ranks", "this check's number of ranks",
         edits=((".div_(world_size)", ".div_(2)"),)),
    # helper 122: float16 handed back passed; a returned tensor and a step before any
    # backward were torch's own words
    Case(EX, "sum-cast-back-to-float16", "as float16",
         edits=(("    future = work.get_future().then(decompress)",
                 "    future = work.get_future().then(\n"
                 "        lambda done: done.value()[0].to(torch.float16))"),)),
    Case(EX, "returns-a-tensor", "the hook returned a tensor",
         edits=(("    future = work.get_future().then(decompress)",
                 "    future = work.get_future().then(lambda done: done.value()[0])\n"
                 "    future = future.wait().float()"),)),
    Case(AMP, "step-before-backward", "ran before any backward",
         edits=(("            to_backward = scaler.scale(loss)  # fp16: small gradients stay "
                 "above 0",
                 "            to_backward = scaler.scale(loss)\n"
                 "            scaler.step(optimizer)\n            scaler.update()"),
                ("    scaler.step(optimizer)  # unscales; skips the step on every rank if a "
                 "gradient is inf/nan\n    scaler.update()  # after a skip: the scale halves\n",
                 "    pass\n"))),
    # helper 134: both were named "the weights never moved", the second "stepped although
    # rank 1's gradient held an inf"
    Case(AMP, "loss-scaled-twice", "the loss was scaled twice",
         edits=(("to_backward = scaler.scale(loss)",
                 "to_backward = scaler.scale(scaler.scale(loss))"),)),
    Case(AMP, "zero-grad-every-micro-batch", "zero_grad ran in every micro-batch",
         edits=(("        with sync:\n", "        optimizer.zero_grad()\n        with sync:\n"),)),
    # helper 158: every tutorial's inline form, beside the stub's own backward line
    Case(AMP, "scaled-backward-inline", "backward ran twice on one micro-batch's graph",
         edits=(("to_backward = scaler.scale(loss)  # fp16", "scaler.scale(loss).backward()  #"),)),
])  # fmt: skip


def test_a_bucket_copied_before_the_sum_arrived_is_named():
    """Chained on the stub's completed Future, the copy runs before gloo's sum has arrived
    (when exactly is a race, so this is the judge alone): each rank's own gradient / n."""
    from ddp_tutorial.exercises.lesson11_hook import STEPS, judge_hook

    plain, alone = [[0.5, -1.0, 2.0]] * STEPS, [[1.0, -4.0, 2.0]] * STEPS
    sent = [[("bfloat16", 6, True)]] * STEPS
    records = [{"plain": plain, "alone": alone, "hooked": [[g / 2 for g in alone[0]]] * STEPS,
                "sent": sent, "bytes_fp32": 12, "buckets": [1] * STEPS,
                # the placeholder: complete as returned, from a hook entered at 0.0, before
                # the other rank's backward began (1.0)
                "returned": [[(True, 0.0)]] * STEPS, "started": [1.0] * STEPS}
               for _ in range(2)]  # fmt: skip
    assert "copied back before the sum arrived" in judge_hook(records)
    records = [{**r, "hooked": plain} for r in records]
    assert "the hook waited inside" in judge_hook(records)
    late = [{**r, "returned": [[(True, 2.0)]] * STEPS} for r in records]  # rank 0 was late
    assert judge_hook(late) is None, "no verdict where the sum may have come in time"
    records = [{**r, "returned": [[(False, 0.0)]] * STEPS} for r in records]
    assert judge_hook(records) is None


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_hooks_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
