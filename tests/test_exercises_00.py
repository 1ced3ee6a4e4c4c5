"""Lesson 00's exercise: wrong conversions of the loop, each named (edits of the solution)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "00_convert_loop"
IDS = 'int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])'
BACKWARD = "            loss.backward()\n"
# each .grad all_reduced by hand after backward (the summed form; + a division: the mean)
REDUCED = (
    BACKWARD + "            for p in model.parameters():\n                dist.all_reduce(p.grad)\n"
)
CASES = register([
    # helper 174: right for this check's 2 ranks and 256 samples only
    Case(EX, "sampler-for-2-replicas", "the number of ranks is written as 2",
         edits=(("    sampler = DistributedSampler(train_set, seed=args.seed)",
                 "    sampler = DistributedSampler(train_set, num_replicas=2, rank=rank, "
                 "seed=args.seed)"),)),
    Case(EX, "sampler-drops-the-tail", None,  # helper 177: lesson 02's other way, no padding
         edits=(("    sampler = DistributedSampler(train_set, seed=args.seed)",
                 "    sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)"),)),
    Case(EX, "loader-drops-the-last-batch", "with 250, each rank would skip 13 samples",
         edits=(("    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)",
                 "    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, "
                 "drop_last=True)"),)),
    # helper 167: the gradients averaged again after DDP's backward passed (equal weights)
    Case(EX, "grads-averaged-again-after-ddp", "all_reduced again after DDP's backward",
         edits=((BACKWARD, REDUCED + "                p.grad /= world_size\n"),)),
    # helper 73: a loss divided by the world size got "wrap the model in DDP"
    Case(EX, "loss-divided-by-the-world-size", "divided by the world size",
         edits=(("            loss = nn.functional.cross_entropy(model(x), y)\n",
                 "            loss = nn.functional.cross_entropy(model(x), y) / world_size\n"),)),
    # helper 147: the lesson's GPU lines copied onto the CPU check
    Case(EX, "device-ids-on-the-cpu", "take the CPU branch",
         edits=(("    model = DDP(model)\n", "    model = DDP(model, device_ids=[0])\n"),)),
    Case(EX, "nccl-on-the-cpu", "take the CPU branch",
         edits=(('init_process_group("gloo")\n', 'init_process_group("nccl")\n'),)),
    Case(EX, "no-set-epoch", "sampler.set_epoch(epoch)",
         edits=(("        sampler.set_epoch(epoch)\n", ""),)),
    Case(EX, "every-rank-saves", "only rank 0 must save",
         edits=(("writer, state = rank == 0,", "writer, state = True,"),)),
    Case(EX, "saves-the-wrapper", "model.module.state_dict()",
         edits=(("model.module.state_dict()", "model.state_dict()"),)),
    Case(EX, "no-sampler", "the DataLoader has no DistributedSampler",
         edits=(("    sampler = DistributedSampler(train_set, seed=args.seed)\n", ""),
                ("        sampler.set_epoch(epoch)\n", ""))),
    Case(EX, "sampler-default-seed", "seed=args.seed",  # passes at seed 0: the check uses 1
         edits=(("(train_set, seed=args.seed)", "(train_set)"),)),
    Case(EX, "not-wrapped", "wrap the model in DDP",
         edits=(("    model = DDP(model)\n", ""),
                ("model.module.state_dict()", "model.state_dict()"))),
    Case(EX, "global-batch-halved", "a global batch of 16, not 32",
         edits=(("batch_size=args.batch_size,", "batch_size=args.batch_size // world_size,"),)),
    Case(EX, "group-left-open", "dist.destroy_process_group()",
         edits=(("    dist.destroy_process_group()\n", ""),)),
    Case(EX, "no-init", "dist.init_process_group",
         edits=(('    dist.init_process_group("gloo")\n', ""),
                ('rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])',
                 "rank, world_size = 0, 1"))),
    Case(EX, "set-epoch-adds-the-seed", "the sampler adds its own seed",
         edits=(("sampler.set_epoch(epoch)", "sampler.set_epoch(args.seed + epoch)"),)),
    Case(EX, "batch-size-times-world", "--batch-size is per process",
         edits=(("batch_size=args.batch_size, sampler",
                 "batch_size=args.batch_size * dist.get_world_size(), sampler"),)),
    # from a learner review: each named for what it is
    Case(EX, "lr-times-world", "this lesson keeps --lr as it is",
         edits=(("lr=args.lr,", "lr=args.lr * world_size,"),)),
    Case(EX, "sampler-not-shuffled", "DistributedSampler(shuffle=False)",
         edits=(("(train_set, seed=args.seed)", "(train_set, shuffle=False, seed=args.seed)"),)),
    Case(EX, "sampler-seeded-per-rank", "the same seed on every rank",
         edits=(("(train_set, seed=args.seed)", "(train_set, seed=args.seed + rank)"),)),
    Case(EX, "saves-the-module-object", "not a state_dict",
         edits=(("rank == 0, model.module.state_dict()", "rank == 0, model.module"),)),
    Case(EX, "prefix-stripped-wrongly", "no prefix to strip by hand",
         edits=(("rank == 0, model.module.state_dict()",
                 "rank == 0, {k[6:]: v for k, v in model.state_dict().items()}"),)),
    # right here only: this model's keys start with a digit, which lstrip leaves alone
    Case(EX, "prefix-lstripped", "right on this check's model only",
         edits=(("rank == 0, model.module.state_dict()",
                 'rank == 0, {k.lstrip("module."): v for k, v in model.state_dict().items()}'),)),
    # from a fifth learner review: one machine's variables (each rank runs as if on a machine
    # of its own); set_epoch and the save on one rank
    Case(EX, "prefix-replaced-everywhere", "right on this check's model only",
         edits=(("rank == 0, model.module.state_dict()",
                 'rank == 0, {k.replace("module.", ""): v\n'
                 "                  for k, v in model.state_dict().items()}"),)),
    Case(EX, "local-variables-for-the-job", "LOCAL_RANK",
         edits=((IDS,
                 'int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])'),)),
    Case(EX, "rank-from-local-rank", "LOCAL_RANK",
         edits=((IDS, 'int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])'),)),
    Case(EX, "world-size-from-local-world-size", "not LOCAL_RANK or LOCAL_WORLD_SIZE",
         edits=((IDS, 'int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])'),)),
    Case(EX, "set-epoch-on-rank-0-only", "not only rank 0",
         edits=(("        sampler.set_epoch(epoch)\n",
                 "        if rank == 0:\n            sampler.set_epoch(epoch)\n"),)),
    Case(EX, "the-last-rank-saves", "rank 0 writes it",
         edits=(("rank == 0, model.module.state_dict()",
                 "rank == world_size - 1, model.module.state_dict()"),)),
    # helper 98: a sampler told rank=LOCAL_RANK got "the DataLoader has no DistributedSampler"
    Case(EX, "sampler-rank-from-local-rank", "told the same rank on both",
         edits=(("(train_set, seed=args.seed)",
                 '(train_set, rank=int(os.environ["LOCAL_RANK"]), seed=args.seed)'),)),
    # helper 129: init given one machine's rank or world size passed (the check replaced them);
    # the rest were named as other mistakes, or not at all
    Case(EX, "init-given-local-rank", "init_process_group(rank=0)",
         edits=(('dist.init_process_group("gloo")',
                 'dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]),\n'
                 '                            world_size=int(os.environ["WORLD_SIZE"]))'),)),
    Case(EX, "init-given-local-world-size", "init_process_group(world_size=1)",
         edits=(('dist.init_process_group("gloo")',
                 'dist.init_process_group("gloo", rank=int(os.environ["RANK"]),\n'
                 '                            world_size=int(os.environ["LOCAL_WORLD_SIZE"]))'),
                (IDS, "dist.get_rank(), dist.get_world_size()"))),
    Case(EX, "init-given-the-global-ids", None,
         edits=(('dist.init_process_group("gloo")',
                 'dist.init_process_group("gloo", rank=int(os.environ["RANK"]),\n'
                 '                            world_size=int(os.environ["WORLD_SIZE"]))'),)),
    Case(EX, "gradients-reduced-again", "on top of DDP's backward, which averaged them already",
         edits=((BACKWARD, REDUCED),)),
    # helper 139: no DDP, the gradients all_reduced by hand and never divided
    Case(EX, "summed-by-hand-without-ddp", "instead of DDP, without dividing by the world size",
         edits=(("    model = DDP(model)\n", ""),
                ("writer, state = rank == 0, model.module.state_dict()",
                 "writer, state = rank == 0, model.state_dict()"),
                (BACKWARD, REDUCED))),
    Case(EX, "sampler-replicas-from-local-world-size", "not LOCAL_WORLD_SIZE",
         edits=(("(train_set, seed=args.seed)",
                 '(train_set, num_replicas=int(os.environ["LOCAL_WORLD_SIZE"]), rank=rank,\n'
                 "                                 seed=args.seed)"),)),
    Case(EX, "writer-by-local-rank", "LOCAL_RANK is 0 on every machine",
         edits=(("rank == 0, model.module.state_dict()",
                 'int(os.environ["LOCAL_RANK"]) == 0, model.module.state_dict()'),)),
    Case(EX, "set-epoch-plus-rank", "set_epoch(epoch + rank)",
         edits=(("sampler.set_epoch(epoch)", "sampler.set_epoch(epoch + rank)"),)),
    # session 30: both were told "wrap the model in DDP" (the first one is wrapped)
    Case(EX, "no-sync-every-step", "training alone on its own samples",
         edits=(("            loss = nn.functional.cross_entropy(model(x), y)\n"
                 "            optimizer.zero_grad()\n            loss.backward()\n",
                 "            with model.no_sync():\n"
                 "                loss = nn.functional.cross_entropy(model(x), y)\n"
                 "                optimizer.zero_grad()\n                loss.backward()\n"),)),
    Case(EX, "loss-summed-over-the-batch", "reduction='sum'",
         edits=(("cross_entropy(model(x), y)", 'cross_entropy(model(x), y, reduction="sum")'),)),
    # helper 158: named as something else, or passed
    Case(EX, "forward-past-the-wrapper", "model.module(x), which bypasses DDP",
         edits=(("cross_entropy(model(x), y)", "cross_entropy(model.module(x), y)"),)),
    Case(EX, "lr-times-sqrt-world-size", "--lr x sqrt(2)",
         edits=(("lr=args.lr, momentum", "lr=args.lr * world_size**0.5, momentum"),)),
    Case(EX, "own-save-writer-false", "the template's `if writer:` block saves it",
         edits=(("    writer, state = rank == 0, model.module.state_dict()\n",
                 "    if dist.get_rank() == 0:\n"
                 '        torch.save(model.module.state_dict(), out / "model.pt")\n'
                 "    writer = False\n"),)),
    Case(EX, "averaged-by-hand-with-the-right-weights", "never wrapped in DDP",
         edits=(("    model = DDP(model)\n", ""),
                ("writer, state = rank == 0, model.module.state_dict()",
                 "writer, state = rank == 0, model.state_dict()"),
                (BACKWARD, REDUCED + "                p.grad /= world_size\n"))),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_conversions_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
