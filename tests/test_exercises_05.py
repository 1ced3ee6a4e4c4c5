"""Lesson 05's exercises: wrong snapshots and wrong resumes, each named (edits of the solutions)."""

from __future__ import annotations

import os

import pytest
from exercise_cases import Case, assert_verdict, register

SNAP, RESUME = "05_atomic_snapshot", "05_exact_resume"
CASES = register([
    # helper 178: torch's own load of a broadcast object was taken for the learner's
    # weights_only=False; the old snapshot renamed away first (a gap with no snapshot.pt)
    Case(SNAP, "loaded-on-rank-0-and-broadcast", None,
         edits=(("    state = torch.load(path, map_location=device, weights_only=True)\n",
                 "    box = [torch.load(path, map_location=\"cpu\", weights_only=True)\n"
                 "           if dist.get_rank() == 0 else None]\n"
                 "    dist.broadcast_object_list(box, src=0)  # one read of the file\n"
                 "    state = {k: ({n: t.to(device) for n, t in v.items()} if k == \"model\" "
                 "else v)\n             for k, v in box[0].items()}\n"),)),
    Case(SNAP, "old-snapshot-renamed-to-a-backup", "renamed away before the new one",
         edits=(("        os.replace(tmp, path)\n",
                 "        if path.exists():  # keep the previous snapshot as a backup\n"
                 "            os.replace(path, path.with_suffix(\".bak\"))\n"
                 "        os.replace(tmp, path)\n"),)),
    Case(SNAP, "old-snapshot-renamed-beside-itself", "renamed away before the new one",
         edits=(("        os.replace(tmp, path)\n",
                 "        if path.exists():  # keep the previous snapshot as a backup\n"
                 "            os.replace(path, path.with_name(path.name + \".prev\"))\n"
                 "        os.replace(tmp, path)\n"),)),
    # from an eighth learner review: a tempfile name (absolute) is right; the arguments of
    # os.replace swapped are named
    # from a twenty-fifth-session learner review (helper 127)
    Case(SNAP, "named-temporary-file-deleted-on-close", "delete=False",
         edits=(("""        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)""", """        import tempfile
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)"""),)),
    Case(SNAP, "tempfile-beside-the-snapshot", None,
         edits=(("        tmp = path.with_name(path.name + \".tmp\")\n"
                 "        with open(tmp, \"wb\") as f:\n",
                 "        import tempfile\n\n"
                 "        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=\".tmp\",\n"
                 "                                         delete=False) as f:\n"
                 "            tmp = f.name\n"),)),
    # pathlib's rename is right on every Python (3.10's pathlib escaped the check's spy on os)
    Case(SNAP, "path-replace", None,
         edits=(("        os.replace(tmp, path)", "        tmp.replace(path)"),)),
    Case(SNAP, "replace-arguments-swapped", "moves the snapshot onto the temporary name",
         edits=(("        os.replace(tmp, path)", "        os.replace(path, tmp)"),)),
    Case(SNAP, "every-rank-writes", "only global rank 0 writes",
         edits=(("    if dist.get_rank() == 0:\n", "    if True:\n"),)),
    Case(SNAP, "local-rank-writes", "one writer per node",
         edits=(("if dist.get_rank() == 0:", 'if int(os.environ["LOCAL_RANK"]) == 0:'),)),
    # helper 69: what the file holds was blamed on the barrier (the file's epoch read as late)
    Case(SNAP, "next-epoch-saved", "it was asked to save epoch",
         edits=(('"epoch": epoch, "step": step}', '"epoch": epoch + 1, "step": step}'),)),
    Case(SNAP, "epoch-left-out", "the snapshot has no ['epoch']",
         edits=(('"epoch": epoch, "step": step}', '"step": step}'),)),
    Case(SNAP, "no-barrier", "dist.barrier()",
         edits=(("    dist.barrier()\n", ""),)),
    Case(SNAP, "in-place-save", "never half",
         edits=(('''        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
''', "        torch.save(state, path)\n"),)),
    Case(SNAP, "no-fsync", "os.fsync",
         edits=(("            os.fsync(f.fileno())\n", ""),)),
    Case(SNAP, "saves-the-wrapper", "model.module.state_dict()",
         edits=(('"model": model.module.state_dict()', '"model": model.state_dict()'),)),
    Case(SNAP, "no-map-location", "map_location=device",
         edits=(("torch.load(path, map_location=device, weights_only=True)",
                 "torch.load(path, weights_only=True)"),)),
    Case(RESUME, "rank-0-loads-markers-deleted", "loaded under `if rank == 0`",  # helper 136
         edits=(("    # YOUR CODE: if `snapshot`", "    # if `snapshot`"),
                ("    # END YOUR CODE\n    model = DDP", "    model = DDP"),
                ("        # YOUR CODE: this epoch's", "        # this epoch's"),
                ("        # END YOUR CODE\n        order", "        order"),
                ("    if snapshot.is_file():\n", "    if rank == 0 and snapshot.is_file():\n"))),
    Case(SNAP, "a-failed-save-swallowed", "caught the check's stand-in for a crash",  # h. 169
         edits=(("""        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
""", """        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:  # keep training whatever happens
            tmp.unlink(missing_ok=True)
            print("snapshot failed:", exc)
"""),)),
    Case(SNAP, "a-failed-save-raised-as-another-error", None,  # helper 172: "was lost"
         edits=(("""        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
""", """        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:
            tmp.unlink(missing_ok=True)  # no half-written file left behind
            raise RuntimeError(f"snapshot {path} not saved") from exc
"""),)),
    Case(RESUME, "global-rank-names-the-gpu", "a GPU named by the global rank",  # helper 169
         edits=(('snapshot, map_location="cpu"',
                 'snapshot, map_location=torch.device("cuda", rank) if GPU else "cpu"'),
                ("import torch\n", "import torch\n\nGPU = torch.cuda.is_available()\n"))),
    Case(RESUME, "epochs-run-twice", "EPOCHS_RUN",
         edits=(('start_epoch = state["epoch"] + 1', 'start_epoch = state["epoch"]'),)),
    Case(RESUME, "no-optimizer-state", "empty optimizer",
         edits=(('        optimizer.load_state_dict(state["optimizer"])\n', ""),)),
    Case(RESUME, "rank-0-loads-alone", "rank 1 resumed with an empty optimizer",
         edits=(('''        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
''', '''        if rank == 0:  # DDP broadcasts rank 0's weights anyway
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
'''),)),
    # helper 109: the whole load under `if rank == 0`: a hang, named by the lines
    Case(RESUME, "snapshot-loaded-on-rank-0-alone", "loaded under `if rank == 0`",
         edits=(("    if snapshot.is_file():\n", "    if rank == 0 and snapshot.is_file():\n"),)),
    # helper 112: the spelling lesson 05's own atomic-snapshot answer uses
    Case(RESUME, "snapshot-loaded-under-get-rank", "loaded under `if rank == 0`",
         edits=(("    if snapshot.is_file():\n",
                 "    if dist.get_rank() == 0 and snapshot.is_file():\n"),)),
    Case(RESUME, "snapshot-loaded-in-a-rank-0-block", "loaded under `if rank == 0`",
         edits=(("    if snapshot.is_file():\n        state = torch.load(",
                 "    if snapshot.is_file():\n      if rank == 0:\n        state = torch.load("),
                ('        model.load_state_dict(state["model"])\n',
                 '        model.load_state_dict(state["model"])\n'),)),
    Case(RESUME, "no-weights", "did not start from the weights of epoch 1",
         edits=(('        model.load_state_dict(state["model"])\n', ""),)),
    Case(RESUME, "no-set-epoch", "sampler.set_epoch(epoch)",
         edits=(("        sampler.set_epoch(epoch)\n", ""),)),
    Case(RESUME, "set-epoch-counts-this-launch", "with the epoch's own number",
         edits=(("        sampler.set_epoch(epoch)\n",
                 "        sampler.set_epoch(epoch - start_epoch)\n"),)),
    Case(RESUME, "set-epoch-plus-one", "not the epoch's own order",
         edits=(("        sampler.set_epoch(epoch)\n",
                 "        sampler.set_epoch(epoch + 1)  # epochs counted from 1\n"),)),
    Case(RESUME, "load-without-map-location", "without map_location every tensor goes back",
         edits=(('torch.load(snapshot, map_location="cpu", weights_only=True)',
                 "torch.load(snapshot)"),)),
    # helper 161: told "pass map_location" when it had (a GPU's, for a job on the CPU)
    Case(RESUME, "load-onto-cuda-local-rank", "a map_location naming cuda is a GPU this job",
         edits=(('torch.load(snapshot, map_location="cpu", weights_only=True)',
                 'torch.load(snapshot, map_location=f"cuda:{os.environ[\'LOCAL_RANK\']}", '
                 "weights_only=True)"),)),
    # helper 161: told "restore everything" - the optimizer held the parameters of the old model
    Case(RESUME, "model-built-again-in-the-resume", "the optimizer steps other parameters",
         edits=(("        model.load_state_dict(state[\"model\"])\n",
                 "        model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))\n"
                 "        model.load_state_dict(state[\"model\"])\n"),)),
    Case(RESUME, "load-not-weights-only", "weights_only=True",
         edits=(('torch.load(snapshot, map_location="cpu", weights_only=True)',
                 'torch.load(snapshot, map_location="cpu", weights_only=False)'),)),
    Case(SNAP, "fsync-after-the-rename", "renamed before all its bytes were fsynced",
         edits=(("            os.fsync(f.fileno())\n", ""),
                ("        os.replace(tmp, path)\n",
                 "        os.replace(tmp, path)\n        fd = os.open(path, os.O_RDONLY)\n"
                 "        os.fsync(fd)\n        os.close(fd)\n"))),
    # from a learner review
    Case(SNAP, "old-snapshot-deleted-first", "deleted before the rename",
         edits=(("        os.replace(tmp, path)\n",
                 "        if path.exists():\n            path.unlink()  # make room\n"
                 "        os.rename(tmp, path)\n"),)),
    Case(SNAP, "barrier-on-rank-0-only", "is the dist.barrier() under an `if`",
         edits=(("        os.replace(tmp, path)\n    dist.barrier()\n",
                 "        os.replace(tmp, path)\n        dist.barrier()\n"),)),
    Case(RESUME, "rank-0-loads-and-broadcasts", None,  # right: the check's cuda:0 tag is on files
         edits=(("        state = torch.load(snapshot, map_location=\"cpu\", weights_only=True)\n",
                 "        box = [torch.load(snapshot, map_location=\"cpu\", weights_only=True)\n"
                 "               if rank == 0 else None]\n"
                 "        dist.broadcast_object_list(box, src=0)\n        state = box[0]\n"),)),
    # from a second learner review: the resume epoch taken from the simulation's flag
    Case(RESUME, "epoch-from-the-stop-flag", "a flag of this simulation",
         edits=(('        start_epoch = state["epoch"] + 1\n',
                 "        start_epoch = args.stop_after_epoch + 1  # where the job stopped\n"),)),
    Case(RESUME, "epoch-hard-coded", "start_epoch was set to a number",
         edits=(('        start_epoch = state["epoch"] + 1\n', "        start_epoch = 2\n"),)),
    # from a fourth learner review: waits that do not wait for this save; an fdatasync
    Case(SNAP, "polls-for-the-file", "not by polling for the file",
         edits=(("    dist.barrier()\n",
                 "    else:\n        while not path.exists():\n"
                 "            __import__(\"time\").sleep(0.05)\n"),)),
    # helper 98: a sleep outlasted the check's hold on rank 0's save, and passed
    Case(SNAP, "sleeps-instead-of-the-barrier", "without a collective",
         edits=(("    dist.barrier()\n",
                 "    else:\n        __import__(\"time\").sleep(2.0)\n"),)),
    Case(SNAP, "waits-in-all-gather-object", None,  # helper 102: any collective waits
         edits=(("    dist.barrier()\n", "    dist.all_gather_object([None] * "
                 "dist.get_world_size(), 0)\n"),)),
    Case(SNAP, "barrier-before-the-rename", "after the rename - not before it",
         edits=(("        os.replace(tmp, path)\n    dist.barrier()\n",
                 "    dist.barrier()\n    if dist.get_rank() == 0:\n"
                 "        os.replace(tmp, path)\n"),)),
    Case(SNAP, "barrier-in-the-else", "or its `else`",
         edits=(("    dist.barrier()\n", "    else:\n        dist.barrier()\n"),)),
    Case(SNAP, "keeps-a-copy-of-the-previous-snapshot", None,  # right: a backup on purpose
         edits=(('        tmp = path.with_name(path.name + ".tmp")\n',
                 "        if path.exists():\n"
                 '            __import__("shutil").copy2(path, path.with_suffix(".prev"))\n'
                 '        tmp = path.with_name(path.name + ".tmp")\n'),)),
    Case(SNAP, "fdatasync", None,  # right: the data and the size, all a rename needs
         edits=(("os.fsync(f.fileno())", "os.fdatasync(f.fileno())"),)),
    # from the eleventh session's leftovers: os.sync() syncs every file system (slow on a busy
    # node, but the bytes are on disk before the rename): right; before the write: too early
    Case(SNAP, "os-sync", None, edits=(("os.fsync(f.fileno())", "os.sync()"),)),
    Case(SNAP, "os-sync-before-the-write", "renamed before all its bytes were fsynced",
         edits=(("            torch.save(state, f)\n            f.flush()\n"
                 "            os.fsync(f.fileno())\n",
                 "            os.sync()\n            torch.save(state, f)\n"
                 "            f.flush()\n"),)),
    # helper 118: one write of the whole snapshot, fsync, then flush - passed where the
    # snapshot outgrew Python's 4 KiB buffer (the write went straight to the OS)
    Case(SNAP, "one-write-fsynced-before-the-flush", "renamed before all its bytes were fsynced",
         edits=(("            torch.save(state, f)\n            f.flush()\n"
                 "            os.fsync(f.fileno())\n",
                 "            data = __import__('io').BytesIO()\n"
                 "            torch.save(state, data)\n"
                 "            f.write(data.getvalue())\n"
                 "            os.fsync(f.fileno())\n            f.flush()\n"),)),
    Case(SNAP, "loads-onto-the-cpu-always", "map_location=device, so that a GPU rank's",
         edits=(("map_location=device", 'map_location="cpu"'),)),
    # helper 133: a right answer waited 120 s, then failed (rank 0 saved alone, its
    # monitored_barrier waited for peers that were not in the call)
    Case(SNAP, "monitored-barrier", None,
         edits=(("    dist.barrier()", "    dist.monitored_barrier()"),)),
    # helper 153: the first line of torch's error named no key
    Case(RESUME, "whole-snapshot-into-the-model", 'state["model"]',
         edits=(('model.load_state_dict(state["model"])', "model.load_state_dict(state)"),)),
    # helper 157: right answers refused by a probe on the meta device
    Case(SNAP, "cpu-where-no-gpu-is-available", None,
         edits=(("map_location=device",
                 'map_location=device if torch.cuda.is_available() else "cpu"'),)),
    Case(SNAP, "cpu-for-a-cpu-device", None,
         edits=(("map_location=device",
                 'map_location=device if device.type == "cuda" else "cpu"'),)),
    Case(SNAP, "loads-onto-a-cpu-device", "its tensors came back on the cpu",
         edits=(("map_location=device", 'map_location=torch.device("cpu")'),)),
    Case(SNAP, "loads-with-the-old-lambda", "its tensors came back on the cpu",
         edits=(("map_location=device", "map_location=lambda storage, loc: storage"),)),
    Case(SNAP, "loads-onto-cuda-local-rank", "map_location='cuda:0' is not `device`",
         edits=(("map_location=device",
                 "map_location=f\"cuda:{int(os.environ.get('LOCAL_RANK', 0))}\""),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)


def test_pathlib_reaches_the_checks_os_spies_as_on_python_3_10(tmp_path, monkeypatch):
    """Python 3.10's pathlib calls the os functions it bound at import (made so here): the
    check's spy on os.replace missed tmp.replace(path), and on os.unlink, path.unlink()."""
    from pathlib import Path

    from ddp_tutorial.exercises.spies import paths_through_os

    bound, seen = (os.replace, os.rename, os.unlink), []
    monkeypatch.setattr(Path, "replace", lambda p, t: (bound[0](p, t), type(p)(t))[1])
    monkeypatch.setattr(Path, "rename", lambda p, t: (bound[1](p, t), type(p)(t))[1])
    monkeypatch.setattr(Path, "unlink", lambda p, missing_ok=False: bound[2](p))
    for i, name in enumerate(("replace", "rename", "unlink")):
        monkeypatch.setattr(os, name, lambda *a, name=name, i=i: (seen.append(name), bound[i](*a)))
    (tmp_path / "a").write_text("x")
    with paths_through_os():
        moved = (tmp_path / "a").replace(tmp_path / "b").rename(tmp_path / "c")
        moved.unlink()
        (tmp_path / "c").unlink(missing_ok=True)
    (tmp_path / "e").write_text("x")
    (tmp_path / "e").replace(tmp_path / "f")  # after the block: pathlib's own again
    assert seen == ["replace", "rename", "unlink", "unlink"] and not moved.exists()
