"""``ddp-tutorial lint``: every rule on a script that breaks it and one that does not; the seed
posts' mistakes and lesson 09's broken cases found; the course's own scripts clean."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from conftest import REPO
from ddp_tutorial.harness.lint import RULES, lint_source, main

CASES = REPO / "tests" / "lint_cases"
HEAD = "import os\nimport torch\nimport torch.distributed as dist\n"

# code: (a script with the mistake, the same script without it)
RULE_CASES: dict[str, tuple[str, str]] = {
    "DDP101": (
        """
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 0:
            dist.all_reduce(t)
        dist.destroy_process_group()
        """,
        """
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.all_reduce(t)
        if rank == 0:
            dist.send(t, 1)  # point-to-point: one side sends, the other receives
        else:
            dist.recv(t, 0)
        dist.destroy_process_group()
        """,
    ),
    "DDP102": (
        """
        rank = dist.get_rank()
        torch.cuda.set_device(rank)
        """,
        """
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        """,
    ),
    "DDP103": (
        """
        sampler = DistributedSampler(data)
        loader = DataLoader(data, sampler=sampler)
        for epoch in range(3):
            for x in loader:
                pass
        """,
        """
        sampler = DistributedSampler(data)
        loader = DataLoader(data, sampler=sampler)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for x in loader:
                pass
        """,
    ),
    "DDP104": (
        "loader = DataLoader(data, shuffle=True, sampler=sampler)",
        "loader = DataLoader(data, shuffle=False, sampler=sampler)",
    ),
    "DDP105": (
        """
        model = DDP(net)
        torch.save(model.module.state_dict(), "w.pt")
        """,
        """
        model = DDP(net)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "w.pt")
        """,
    ),
    "DDP106": (
        """
        model = DDP(net)
        if args.local_rank == 0:
            torch.save(model.module.state_dict(), "w.pt")
        """,
        """
        model = DDP(net)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "w.pt")
        """,
    ),
    "DDP107": (
        """
        model = DDP(net)
        state = model.state_dict()
        """,
        """
        model = DDP(net)
        state = model.module.state_dict()
        """,
    ),
    "DDP108": (
        'state = torch.load("w.pt")',
        'state = torch.load("w.pt", map_location="cpu", weights_only=True)',
    ),
    "DDP109": (
        """
        dist.init_process_group("nccl")
        dist.destroy_process_group()
        """,
        """
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        dist.destroy_process_group()
        """,
    ),
    "DDP110": (
        """
        model = Net().cuda()
        torch.cuda.set_device(local_rank)
        """,
        """
        torch.cuda.set_device(local_rank)
        model = Net().cuda()
        """,
    ),
    "DDP111": (
        'dist.init_process_group("gloo")',
        """
        dist.init_process_group("gloo")
        try:
            train()
        finally:
            dist.destroy_process_group()
        """,
    ),
    "DDP112": (
        """
        n = torch.cuda.device_count()
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
        """,
        """
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
        n = torch.cuda.device_count()
        """,
    ),
    "DDP113": (
        'parser.add_argument("--local_rank", type=int, default=0)',
        'local_rank = int(os.environ["LOCAL_RANK"])',
    ),
    "DDP114": (
        "model = DDP(net, find_unused_parameters=True)",
        "model = DDP(net)",
    ),
    "DDP115": (
        "plain = {k[7:]: v for k, v in state.items()}",
        "plain = {k.removeprefix('module.'): v for k, v in state.items()}",
    ),
    "DDP124": (
        'plain = {k.lstrip("module."): v for k, v in state.items()}',
        'plain = {k.removeprefix("module."): v for k, v in state.items()}',
    ),
    "DDP130": (  # pytorch/examples' multinode.py (helper 138)
        "torch.accelerator.device_index(local_rank)",
        "torch.accelerator.set_device_index(local_rank)",
    ),
    "DDP116": (
        "model = torch.nn.DataParallel(net)",
        "model = torch.nn.parallel.DistributedDataParallel(net)",
    ),
    "DDP117": (
        'os.environ["RANK"] = "0"',
        'os.environ["MASTER_PORT"] = "0"',
    ),
    "DDP118": (
        """
        dist.init_process_group("gloo")
        bar = tqdm(loader)
        dist.destroy_process_group()
        """,
        """
        dist.init_process_group("gloo")
        bar = tqdm(loader, disable=dist.get_rank() != 0)
        dist.destroy_process_group()
        """,
    ),
    "DDP119": (
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(4, 2)
                self.aux = nn.Linear(4, 2)

            def forward(self, x):
                return self.body(x)
        """,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(4, 2)
                self.aux = nn.Linear(4, 2)

            def forward(self, x):
                return self.body(x) + self.aux(x)
        """,
    ),
    "DDP120": (
        """
        counts = torch.bincount(labels)
        dist.all_reduce(counts)
        """,
        """
        counts = torch.bincount(labels, minlength=10)
        dist.all_reduce(counts)
        """,
    ),
    "DDP121": (
        """
        model = DDP(net)
        data = batches(2 + rank)
        for x, y in data:
            loss_fn(model(x), y).backward()
        """,
        """
        model = DDP(net)
        data = batches(2 + rank)
        with Join([model]):
            for x, y in data:
                loss_fn(model(x), y).backward()
        """,
    ),
    "DDP122": (
        """
        if rank == 0:
            download(url)
        dist.barrier()
        """,
        """
        patient = dist.new_group(timeout=timedelta(hours=2))
        if rank == 0:
            download(url)
        dist.barrier(group=patient)  # a group made for the long wait
        """,
    ),
    "DDP123": (
        """
        for epoch in range(epochs):
            train_one_epoch()
            if epoch % 10 == 0:
                torch.save(model.state_dict(), "w.pt")
        """,
        """
        for epoch in range(epochs):
            train_one_epoch()
            if epoch % 10 == 0:
                torch.save(model.state_dict(), "w.pt")
        torch.save(model.state_dict(), "w.pt")
        """,
    ),
    "DDP125": (
        """
        dist.init_process_group("gloo")
        loader = DataLoader(data, batch_size=32, shuffle=True)
        for epoch in range(3):
            for x, y in loader:
                loss_fn(model(x), y).backward()
        dist.destroy_process_group()
        """,
        """
        dist.init_process_group("gloo")
        sampler = DistributedSampler(data)
        loader = DataLoader(data, batch_size=32, sampler=sampler)
        val_loader = DataLoader(val_data, batch_size=64)  # evaluated, not trained on: no flag
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()
            for x, y in val_loader:
                model(x)
        dist.destroy_process_group()
        """,
    ),
    "DDP126": (
        """
        for step, group in enumerate(micro_batches):
            for x, y in group:
                with model.no_sync():  # every micro-batch, the last one too
                    (loss_fn(model(x), y) / len(group)).backward()
            optimizer.step()
        """,
        """
        for step, group in enumerate(micro_batches):
            for i, (x, y) in enumerate(group):
                ctx = nullcontext() if i == len(group) - 1 else model.no_sync()
                with ctx:
                    (loss_fn(model(x), y) / len(group)).backward()
            optimizer.step()
        """,
    ),
    "DDP127": (  # the official DDP tutorial's demo_checkpoint, without its barrier
        """
        rank = dist.get_rank()
        path = "model.checkpoint"
        if rank == 0:
            torch.save(model.state_dict(), path)
        state = torch.load(path, map_location={"cuda:0": f"cuda:{rank}"}, weights_only=True)
        """,
        """
        rank = dist.get_rank()
        path = "model.checkpoint"
        if rank == 0:
            torch.save(model.state_dict(), path)
        dist.barrier()  # the others load only once rank 0 has written it
        state = torch.load(path, map_location={"cuda:0": f"cuda:{rank}"}, weights_only=True)
        """,
    ),
    "DDP128": (  # a metric summed on the CPU, written with gloo, then run on GPUs
        """
        dist.init_process_group("nccl")
        totals = torch.tensor([loss_sum, count])
        dist.all_reduce(totals)
        dist.destroy_process_group()
        """,
        """
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        totals = torch.tensor([loss_sum, count], device=device)
        dist.all_reduce(totals)
        dist.destroy_process_group()
        """,
    ),
    "DDP129": (  # dino's utils, NVIDIA's NCF: fine until a layer's name ends in "module"
        'plain = {k.replace("module.", ""): v for k, v in state.items()}',
        'plain = {k.removeprefix("module."): v for k, v in state.items()}',
    ),
}


def codes(source: str) -> list[str]:
    return [f.code for f in lint_source(HEAD + textwrap.dedent(source), "case.py")]


def test_the_linters_wrapper_prefixes_are_the_sidecars():
    """lint repeats ddp_kit's WRAPPER_PREFIXES (it never imports torch): kept equal here."""
    from ddp_tutorial._kit import kit
    from ddp_tutorial.harness.lint_rules import WRAPPER_PREFIXES

    assert WRAPPER_PREFIXES == kit.WRAPPER_PREFIXES


def test_every_rule_has_a_case_and_names_a_lesson_that_exists():
    assert set(RULE_CASES) == set(RULES)
    lessons = {p.name[:2] for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert {lesson for _, lesson in RULES.values()} <= lessons
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"(lesson NN)` for {len(RULES)} mistakes" in readme, "the README's count of rules"


@pytest.mark.parametrize("code", sorted(RULE_CASES))
def test_a_rule_flags_the_mistake_and_not_the_fix(code):
    bad, good = RULE_CASES[code]
    assert code in codes(bad), f"{code} missed its mistake"
    assert code not in codes(good), f"{code} flagged the fixed script"


def test_a_finding_reads_like_a_linter_line_with_its_lesson():
    (finding,) = lint_source(HEAD + "state = torch.load('w.pt')\n", "train.py")
    assert re.fullmatch(r"train\.py:4: DDP108 .+ \(lesson 05\)", finding.format())


def test_an_ignore_comment_silences_one_line():
    assert codes("state = torch.load('w.pt')  # ddp-lint: ignore[DDP108]") == []
    assert codes("state = torch.load('w.pt')  # ddp-lint: ignore[DDP101]") == ["DDP108"]
    assert codes("state = torch.load('w.pt')  # ddp-lint: ignore") == []


# The mistakes of lesson 00's table that the seeds' code shows, by seed. Not in the list (no
# code to read them from): Adam's betas=(0, ...) and the MSELoss broadcast (values at run
# time), "it cannot be debugged" (prose), batch_size * len(device_ids) (right for the
# DataParallel it is written for).
SEED_MISTAKES = {
    "seed_000.py": {
        "DDP113",  # torch.distributed.launch and --local_rank
        "DDP102",  # the device from dist.get_rank()
        "DDP112",  # CUDA_VISIBLE_DEVICES set inside the script, after CUDA started
        "DDP114",  # find_unused_parameters=True always
        "DDP106",  # the save guarded by local_rank == 0
        "DDP103",  # no set_epoch
        "DDP108",  # torch.load("0.pth") onto the saving device
        "DDP111",  # no destroy_process_group
    },
    "seed_001.py": {
        "DDP117",  # RANK='0' for every spawned child
        "DDP118",  # tqdm on every rank
        "DDP103",  # no set_epoch
        "DDP123",  # the last epoch never saved
        "DDP111",  # no destroy_process_group
        "DDP114",  # find_unused_parameters=True
    },
    "seed_002.py": {"DDP116", "DDP115"},  # DataParallel; k[7:]
}


@pytest.mark.parametrize("name", sorted(SEED_MISTAKES))
def test_lint_finds_every_mistake_of_the_seeds_code(name):
    path = CASES / name
    found = {f.code for f in lint_source(path.read_text(), name)}
    assert found == SEED_MISTAKES[name], (
        f"missed {SEED_MISTAKES[name] - found}, extra {found - SEED_MISTAKES[name]}"
    )


# lesson 09's debugging lab: each broken case, and the rule that finds it in its code
LAB_CASES = {
    "case_unused": ("DDP119", "WithAux"),  # the dead head is in the model, not the case
    "case_skip": ("DDP101", "case_skip"),
    "case_shape": ("DDP120", "case_shape"),
    "case_rank0_eval": ("DDP101", "case_rank0_eval"),
    "case_uneven": ("DDP121", "case_uneven"),
    "case_slow": ("DDP122", "case_slow"),
    "case_keys": ("DDP107", "case_keys"),
}


def test_lint_finds_every_broken_case_of_lesson_09():
    path = REPO / "scripts" / "demos" / "debug_lab.py"
    tree = ast.parse(path.read_text())
    spans = {
        n.name: (n.lineno, n.end_lineno)
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.ClassDef)
    }
    lab = importable_cases(tree)
    assert set(LAB_CASES) == lab, "a case of the lab has no rule here (or one was removed)"
    findings = lint_source(path.read_text(), str(path))
    for case, (code, where) in LAB_CASES.items():
        first, last = spans[where]
        hits = [f for f in findings if f.code == code and first <= f.line <= last]
        assert hits, f"{case}: no {code} finding in {where} (lines {first}-{last})"


def importable_cases(tree: ast.Module) -> set[str]:
    """The lab's broken cases: CASES minus the breakpoint (a tool, not a mistake) and wrap
    (right code: DDP under DETAIL crashes on a machine without a GPU, torch's bug)."""
    cases = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CASES"
    )
    assert isinstance(cases, ast.Dict)
    return {v.id for v in cases.values if isinstance(v, ast.Name)} - {
        "case_breakpoint",
        "case_wrap",
    }


def test_lint_flags_the_exercise_stubs_that_hold_the_mistake_to_fix():
    """The learner can run the linter on a stub: exercise 09's hang is flagged before any launch."""
    stub = REPO / "scripts" / "exercises" / "09_find_the_hang.py"
    assert "DDP101" in {f.code for f in lint_source(stub.read_text(), str(stub))}


COURSE_SCRIPTS = [
    "scripts/single_process.py",
    "scripts/minimal_ddp.py",
    "scripts/resumable_ddp.py",
    "scripts/train.py",
    "scripts/ddp_kit.py",  # helper 103: the copied pair is linted together (`lint .`)
    "scripts/exercises/solutions",
    "scripts/benchmark.py",
    "scripts/compare",
]


def test_the_course_scripts_and_every_exercise_solution_pass():
    import io

    out = io.StringIO()
    solutions = list((REPO / "scripts/exercises/solutions").glob("*.py"))
    assert len(solutions) >= 13
    status = main([str(REPO / p) for p in COURSE_SCRIPTS], out=out, err=out)
    assert status == 0, out.getvalue()


def test_the_world_size_and_a_stores_methods_are_no_rank_branch_or_collective():
    """Helper 103, the sidecar's four false findings: ``rank, world = _rank_world()`` made
    ``if world > 1`` a rank test; ``store.check(...)`` under ``if rank == 0`` was taken for
    the file's own ``check``, which all_reduces. A method is reached through an object, a
    function of the file by its bare name; an object made by an imported class is not ours."""
    world = """
        def _rank_world():
            return dist.get_rank(), dist.get_world_size()

        def share(names):
            rank, world = _rank_world()
            if world > 1:
                dist.broadcast_object_list(names, src=0)
        """
    assert "DDP101" not in codes(world)
    assert "DDP101" in codes(world.replace("if world > 1", "if rank > 0"))  # still a rank
    function = """
        def check(flag):
            t = torch.tensor([flag])
            dist.all_reduce(t)

        def wait_for_peers(store):
            if dist.get_rank() == 0:
                store.check(["ready"])
        """
    assert "DDP101" not in codes(function)
    assert "DDP101" in codes(function.replace('store.check(["ready"])', "check(1)"))
    method = """
        class Stop:
            def check(self):
                dist.all_reduce(torch.zeros(1))

        def wait_for_peers(stop):
            kv = dist.TCPStore("h", 1, 2, True)
            if dist.get_rank() == 0:
                kv.check(["ready"])
        """
    assert "DDP101" not in codes(method)
    assert "DDP101" in codes(method.replace('kv.check(["ready"])', "stop.check()"))
    # helper 104: a name is judged by its last binding before the call, not by any binding in
    # the file; torch.compile hands back this file's model; the world size only from a helper
    rebound = """
        import torchvision

        class Net(torch.nn.Module):
            def evaluate(self):
                dist.all_reduce(torch.zeros(1))

        def other():
            model = torchvision.models.resnet18()

        def main():
            model = torch.compile(Net())
            if dist.get_rank() == 0:
                model.evaluate()
        """
    assert "DDP101" in codes(rebound)
    ranked = world.replace("rank, world = _rank_world()", "world = dist.get_rank() % 2")
    assert "DDP101" in codes(ranked.replace("if world > 1", "if world == 0"))
    assert "DDP101" not in codes(world.replace("rank, world", "rank, size").replace(
        "if world > 1", "if size > 1"))  # fmt: skip


def test_the_command_exits_1_on_a_finding_and_2_on_a_file_it_cannot_read(tmp_path, capsys):
    from ddp_tutorial.harness.cli import main as cli

    bad = tmp_path / "bad.py"
    bad.write_text(HEAD + 'state = torch.load("w.pt")\n')
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert cli(["lint", str(bad)]) == 1
    assert f"{bad}:4: DDP108" in capsys.readouterr().out
    assert cli(["lint", str(REPO / "scripts/minimal_ddp.py")]) == 0
    clean = capsys.readouterr()  # helper 132: a clean file printed nothing at all
    assert clean.out == "" and clean.err == "no findings in 1 file(s)\n", clean
    assert cli(["lint", str(broken)]) == 2
    assert "not Python the linter can parse" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # helper 103: a folder without Python exited 0, silent
    assert main([str(tmp_path / "empty")]) == 2
    assert "no Python file in" in capsys.readouterr().err
    # helper 104: ... and it stopped the other paths from being read
    assert main([str(tmp_path / "empty"), str(REPO / "tests/lint_cases/seed_001.py")]) == 1
    assert "no Python file in" in capsys.readouterr().err


def test_a_test_of_whether_torchrun_started_the_script_is_no_rank_branch():
    """nanoGPT's ``ddp = int(os.environ.get("RANK", -1)) != -1``: the same on every rank."""
    for test in ('int(os.environ.get("RANK", -1)) != -1', '"RANK" in os.environ'):
        assert codes(f"ddp = {test}\nif ddp:\n    dist.all_reduce(t)\n") == []
    assert codes('rank = int(os.environ.get("RANK", 0))\nif rank:\n    dist.all_reduce(t)\n') == [
        "DDP101"
    ]


def test_the_unwrap_idiom_after_a_conditional_wrap_is_the_plain_model():
    """nanoGPT: ``if ddp: model = DDP(model)``, then ``raw_model = model.module if ddp else
    model``: raw_model.state_dict() has no prefix. (Lesson 09's ``net = model.module if fix
    else model`` after an unconditional wrap stays a wrapper: see the lab's test.)"""
    source = """
    if ddp:
        model = DDP(model)
    raw_model = model.module if ddp else model
    state = raw_model.state_dict()
    """
    assert "DDP107" not in codes(source)
    assert "DDP107" in codes(source.replace("raw_model.state_dict", "model.state_dict"))


def test_the_idioms_a_review_found_flagged_are_not_and_the_mistakes_still_are():
    """A reviewer's 58 scripts (helper 51): six correct idioms, each common in real code, were
    flagged with advice that breaks them; each is now quiet, and the mistake it resembles is
    still found."""
    rank_0_first = """
    rank = dist.get_rank()
    if rank != 0:
        dist.barrier()  # the others wait while rank 0 prepares the data
    data = prepare()
    if rank == 0:
        dist.barrier()  # rank 0 done: every rank reached exactly one barrier
    """
    assert codes(rank_0_first) == []
    yolo = rank_0_first.replace("if rank != 0:", "if rank not in [-1, 0]:")  # YOLOv5, HF
    assert codes(yolo) == []
    assert codes(rank_0_first.replace("if rank != 0:", "if rank == 1:")) == ["DDP101", "DDP101"]
    fallback = """
    if distributed:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        model = DDP(model, device_ids=[local_rank])
    elif torch.cuda.device_count() > 1:  # one process, several GPUs (pytorch/examples)
        model = torch.nn.DataParallel(model)
    """  # helper 114: the deliberate fallback beside DDP; DDP111 once, not per init call
    assert codes(fallback + 'dist.init_process_group("gloo")\n') == ["DDP111"]
    assert codes(fallback.replace("model = DDP(model, device_ids=[local_rank])", "pass")) == [
        "DDP111", "DDP116"]  # fmt: skip
    for others in ("if rank > 0:", "if rank >= 1:"):  # YOLOX's wait_for_the_master (helper 114)
        assert codes(rank_0_first.replace("if rank != 0:", others)) == [], others
    assert codes(rank_0_first.replace("if rank == 0:", "if rank < 1:")) == []
    assert codes(rank_0_first.replace("if rank != 0:", "if rank > 1:")) == ["DDP101", "DDP101"]
    hf_unwrap = """
    model = DDP(model)
    model_to_save = model.module if hasattr(model, "module") else model
    if dist.get_rank() == 0:
        torch.save(model_to_save.state_dict(), "pytorch_model.bin")
    """
    assert codes(hf_unwrap) == []
    assert codes(hf_unwrap.replace("model_to_save.state_dict", "model.state_dict")) == ["DDP107"]
    guarded_strip = """
    state = {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()}
    for k in list(sd):
        if k.startswith("module."):
            sd[k[7:]] = sd.pop(k)
    """
    assert codes(guarded_strip) == []
    assert codes("state = {k[7:]: v for k, v in sd.items()}\n") == ["DDP115"]
    bar_on_rank_0 = """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    it = tqdm(loader) if rank == 0 else loader
    if rank == 0:
        bar = tqdm(total=100)
    dist.destroy_process_group()
    """
    assert codes(bar_on_rank_0) == []
    assert codes(bar_on_rank_0.replace("if rank == 0 else loader", "")) == ["DDP118"]
    layers = """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.act, self.drop = nn.GELU(), nn.Dropout(0.1)
            self.act2 = nn.GELU()
            self.drop2 = nn.Dropout(0.1)
            self.criterion = nn.CrossEntropyLoss()
            self.teacher = nn.Linear(2, 2)
            self.teacher.requires_grad_(False)  # frozen: no gradient for DDP to wait for
            self.extra = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)
    """
    assert [f.message.split(" ")[0] for f in lint_source(HEAD + textwrap.dedent(layers))] == [
        "Net.extra"
    ]
    last_epoch_too = """
    for epoch in range(args.epochs):
        train()
        if dist.get_rank() == 0 and ((epoch + 1) % k == 0 or epoch == args.epochs - 1):
            torch.save(model.module.state_dict(), "m.pt")
    """
    assert codes(last_epoch_too) == []
    assert codes(last_epoch_too.replace(" or epoch == args.epochs - 1", "")) == ["DDP123"]


def test_a_save_in_an_mp_spawn_worker_runs_on_every_rank():
    """The official tutorial's layout (helper 51): mp.spawn(worker) never calls worker by
    name, and the save in it was judged by its callers - none, so never flagged."""
    source = """
    import torch.multiprocessing as mp

    def worker(rank, world_size):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.save(model.module.state_dict(), "ckpt.pt")
        dist.destroy_process_group()

    mp.spawn(worker, args=(2,), nprocs=2)
    """
    assert codes(source) == ["DDP105"]
    save = "        torch.save("
    guarded = source.replace(save, "        if rank == 0:\n    " + save)
    assert codes(guarded) == []


def test_set_epoch_is_seen_through_attributes_conditions_and_helpers():
    """Helper 51's DDP103 false positives: a sampler kept as ``self.train_sampler``, one made
    ``... if ddp else None``, one given set_epoch inside a helper; each has its set_epoch. The
    conditional one without it is named, not "(made in the DataLoader call)"."""
    kept = """
    class Trainer:
        def __init__(self, ds):
            self.train_sampler = DistributedSampler(ds)
        def train(self, epochs):
            for epoch in range(epochs):
                self.train_sampler.set_epoch(epoch)
    """
    conditional = """
    sampler = DistributedSampler(ds) if dist.is_initialized() else None
    for epoch in range(3):
        sampler.set_epoch(epoch)
    """
    helper = """
    def train_one_epoch(loader, sampler, epoch):
        sampler.set_epoch(epoch)
    train_sampler = DistributedSampler(ds)
    for epoch in range(3):
        train_one_epoch(loader, train_sampler, epoch)
    """
    for source in (kept, conditional, helper):
        assert codes(source) == [], source
    (finding,) = lint_source(HEAD + textwrap.dedent(conditional.replace("sampler.set_epoch", "x")))
    assert finding.code == "DDP103" and "call sampler.set_epoch(epoch)" in finding.message


def test_the_global_rank_in_a_device_string_is_found():
    """``f"cuda:{rank}"`` and ``"cuda:" + str(rank)`` (helper 51: missed); LOCAL_RANK is right."""
    for spelling in ('torch.device(f"cuda:{rank}")', 'x.to(f"cuda:{rank}")',
                     'torch.device("cuda:" + str(rank))'):  # fmt: skip
        assert codes(f"rank = dist.get_rank()\ndevice = {spelling}\n") == ["DDP102"], spelling
        local = f"rank = int(os.environ['LOCAL_RANK'])\ndevice = {spelling}\n"
        assert codes(local) == [], spelling


def test_a_save_behind_a_local_rank_by_another_name_is_one_writer_per_node():
    """``gpu = int(os.environ["LOCAL_RANK"])``, ``rank = int(os.environ["LOCAL_RANK"])``:
    ``if gpu == 0: torch.save(...)`` is one writer per node (DDP106), not rank 0 alone and not
    every rank (helper 51: no finding at all)."""
    for name in ("gpu", "rank"):
        source = f"""
        dist.init_process_group("gloo")
        {name} = int(os.environ["LOCAL_RANK"])
        if {name} == 0:
            torch.save(model.module.state_dict(), "m.pt")
        dist.destroy_process_group()
        """
        assert codes(source) == ["DDP106"], name


def test_a_collective_in_a_helper_that_rank_0_alone_calls_is_found():
    """The classic "evaluate on rank 0 only" hang (helper 51: missed): the helper's all_reduce
    is named at the call in the branch; the same helper called on every rank is fine."""
    source = """
    def evaluate(model, loader):
        correct = torch.zeros(1)
        dist.all_reduce(correct)
        return correct

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        accuracy = evaluate(model, loader)
    dist.destroy_process_group()
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(source))
    assert finding.code == "DDP101" and "dist.all_reduce" in finding.message
    assert finding.line == HEAD.count("\n") + 9, "at the call in the branch"
    everyone = source.replace("if dist.get_rank() == 0:\n        accuracy", "accuracy")
    assert codes(everyone) == []


def test_a_file_per_rank_a_world_of_one_and_the_hyphenated_argument():
    """Helper 51: a save to a per-rank file or to memory is no shared file (DDP105 said it
    was); setting RANK only when no launcher did is a world of one (DDP117 flagged it); the
    launcher's hyphenated --local-rank is the deprecated argument too (DDP113 missed it)."""
    own_files = """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.save(torch.get_rng_state(), f"ckpt/rng_rank{rank}.pt")
    torch.save(model.state_dict(), io.BytesIO())
    dist.destroy_process_group()
    """
    assert codes(own_files) == []
    assert codes(own_files.replace('f"ckpt/rng_rank{rank}.pt"', '"ckpt/rng.pt"')) == ["DDP105"]
    alone = 'if "RANK" not in os.environ:\n    os.environ["RANK"] = "0"\n'
    assert codes(alone) == []
    assert codes('os.environ["RANK"] = "0"\n') == ["DDP117"]
    assert codes('parser.add_argument("--local-rank", type=int)\n') == ["DDP113"]
    # a practitioner's run (helper 81): memory held in a name, and a tokenizer written (fast)
    # by rank 0 alone, were flagged; tokenising or training one alone still is
    in_memory = own_files.replace("io.BytesIO())", "buffer)").replace(
        "    torch.save(model", "    buffer = io.BytesIO()\n    torch.save(model"
    )
    assert "buffer = io.BytesIO()" in in_memory and codes(in_memory) == []
    assert codes(in_memory.replace("buffer)", '"w.pt")')) == ["DDP105"]
    first = (
        'dist.init_process_group("gloo")\nif dist.get_rank() == 0:\n    {}(tok)\n'
        "dist.barrier()\ndist.destroy_process_group()\n"
    )
    assert codes(first.format("write_tokenizer")) == codes(first.format("load_tokenizer")) == []
    for slow in ("tokenize_dataset", "train_tokenizer", "pretokenize"):
        assert codes(first.format(slow)) == ["DDP122"], slow


def test_the_official_tutorials_trainer_saves_once_per_node():
    """The official series' ``Trainer``: ``self.gpu_id = int(os.environ["LOCAL_RANK"])`` in
    ``__init__``, ``if self.gpu_id == 0: self._save_snapshot(epoch)`` in ``train``: one writer
    per node (DDP106), named once at the call. Before, a method named ``save`` was taken for a
    caller of itself (its own ``torch.save``), and the guard in another method went unseen:
    two DDP105 findings. The global rank kept on ``self`` guards it right."""
    source = """
    class Trainer:
        def __init__(self, model):
            self.gpu_id = int(os.environ["LOCAL_RANK"])
            self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])

        def save(self, epoch):
            torch.save(self.model.module.state_dict(), "checkpoint.pt")

        def train(self, epochs):
            for epoch in range(epochs):
                if self.gpu_id == 0:
                    self.save(epoch)

    dist.init_process_group("gloo")
    Trainer(net).train(3)
    dist.destroy_process_group()
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(source))
    assert (finding.code, finding.line) == ("DDP106", HEAD.count("\n") + 13), finding
    assert "self.gpu_id" in finding.message
    right = source.replace(
        'self.gpu_id = int(os.environ["LOCAL_RANK"])',
        'self.gpu_id = int(os.environ["LOCAL_RANK"])\n            self.rank = dist.get_rank()',
    ).replace("if self.gpu_id == 0:", "if self.rank == 0:")
    assert codes(right) == []
    assert codes(right.replace("self.rank = dist.get_rank()", "self.rank = self.gpu_id")) == [
        "DDP106"
    ]


def test_an_aliased_sampler_and_the_other_loaders_set_epoch_are_seen():
    """``DistributedSampler as DS`` was no sampler to the linter, and a set_epoch on
    ``val_loader.sampler`` silenced the training sampler that never got one (any
    ``.sampler`` could be it): the loader's own sampler is now looked up."""
    alias = """
    from torch.utils.data.distributed import DistributedSampler as DS
    sampler = DS(ds)
    loader = DataLoader(ds, sampler=sampler)
    for epoch in range(3):
        for x in loader:
            pass
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(alias))
    assert finding.code == "DDP103" and "sampler.set_epoch" in finding.message
    fixed = alias.replace(
        "    for x in loader:", "    sampler.set_epoch(epoch)\n    for x in loader:"
    )
    assert codes(fixed) == []
    two = """
    train_loader = DataLoader(ds, sampler=DistributedSampler(ds))
    val_loader = DataLoader(ds, sampler=DistributedSampler(ds, shuffle=True))
    for epoch in range(3):
        val_loader.sampler.set_epoch(epoch)
        for x in train_loader:
            pass
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(two))
    assert finding.code == "DDP103" and "train_loader.sampler.set_epoch" in finding.message
    assert finding.line == HEAD.count("\n") + 2
    both = two.replace("    for x in", "    train_loader.sampler.set_epoch(epoch)\n    for x in")
    assert codes(both) == []
    unknown = two.replace("val_loader.sampler", "loaders['val'].sampler")  # cannot tell which
    assert codes(unknown) == []


def test_a_save_no_caller_guards_is_named_at_its_own_line():
    """A save in ``main()`` was reported at the ``main()`` call at the bottom of the file
    (the helper-call logic); it is the save's line that needs the guard. A helper called
    from a guarded and an unguarded place is still named at the unguarded call."""
    source = """
    def main():
        dist.init_process_group("gloo")
        torch.save(model.module.state_dict(), "m.pt")
        dist.destroy_process_group()

    main()
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(source))
    assert (finding.code, finding.line) == ("DDP105", HEAD.count("\n") + 4)
    helper = """
    def save(model):
        torch.save(model.module.state_dict(), "m.pt")

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        save(model)
    save(model)
    dist.destroy_process_group()
    """
    (finding,) = lint_source(HEAD + textwrap.dedent(helper))
    assert (finding.code, finding.line) == ("DDP105", HEAD.count("\n") + 8)


def test_a_save_through_a_helper_that_skips_the_last_epoch_is_found():
    """The official series' loop: ``if self.gpu_id == 0 and epoch % self.save_every == 0:
    self._save_snapshot(epoch)``, the torch.save inside the helper: DDP123 looked for
    torch.save in the loop itself and missed it; a save after the loop still clears it."""
    source = """
    class Trainer:
        def _save_snapshot(self, epoch):
            torch.save(self.model.module.state_dict(), "snapshot.pt")

        def train(self, max_epochs):
            for epoch in range(max_epochs):
                if dist.get_rank() == 0 and epoch % self.save_every == 0:
                    self._save_snapshot(epoch)
    """
    assert codes(source) == ["DDP123"]
    after = source + "            self._save_snapshot(max_epochs - 1)\n"
    assert codes(after) == []


def test_nccl_without_device_id_is_no_finding_once_the_script_sets_its_device(tmp_path):
    """A practitioner's review: DDP109 fired on 7 of 14 correct public scripts, all calling
    torch.cuda.set_device(local_rank) (seeds 000 and 001 too): barrier() then uses that GPU
    in torch 2.14, and device_id only mutes a warning. Without either, it is a finding."""
    from ddp_tutorial.harness.lint import lint_source

    bare = "import torch.distributed as dist\ndist.init_process_group('nccl')\n"
    tail = "dist.destroy_process_group()\n"
    assert "DDP109" in {f.code for f in lint_source(bare + tail)}
    with_device = bare + "torch.cuda.set_device(local_rank)\n" + tail
    assert "DDP109" not in {f.code for f in lint_source(with_device)}


def test_a_backend_computed_as_nccl_or_gloo_still_needs_a_device_on_its_gpu_branch():
    """A practitioner's review: ``"nccl" if torch.cuda.is_available() else "gloo"`` (inline, or
    through a name) hid DDP109: the GPU branch binds no device either."""
    from ddp_tutorial.harness.lint import lint_source

    head = "import torch\nimport torch.distributed as dist\n"
    choice = '"nccl" if torch.cuda.is_available() else "gloo"'
    tail = "dist.destroy_process_group()\n"
    inline = head + f"dist.init_process_group(backend={choice})\n" + tail
    named = head + f"backend = {choice}\ndist.init_process_group(backend)\n" + tail
    for source in (inline, named):
        assert "DDP109" in {f.code for f in lint_source(source)}, source
    bound = named.replace(tail, "torch.cuda.set_device(local_rank)\n" + tail)
    unknown = head + "dist.init_process_group(backend=args.backend)\n" + tail  # a flag: unknown
    assert not {"DDP109"} & {f.code for s in (bound, unknown) for f in lint_source(s)}


def test_the_state_dict_of_a_wrapper_held_in_an_attribute_is_found():
    """A practitioner's review: the official series' Trainer style (self.model = DDP(...))
    saved self.model.state_dict() unflagged; the plain model's own is left alone."""
    from ddp_tutorial.harness.lint import lint_source

    source = (
        "class Trainer:\n"
        "    def __init__(self, model, gpu_id):\n"
        "        self.model = DDP(model, device_ids=[gpu_id])\n"
        "        self.plain = model\n"
        "    def save(self):\n"
        "        torch.save(self.model.state_dict(), 'w.pt')\n"
        "        torch.save(self.plain.state_dict(), 'p.pt')\n"
    )
    found = [(f.code, f.line) for f in lint_source(source) if f.code == "DDP107"]
    assert found == [("DDP107", 6)], found


def test_a_device_built_from_the_global_rank_is_found_where_it_is_used():
    """A practitioner's review: device = f"cuda:{rank}" (rank from RANK), then
    set_device(device), .to(device), device_ids=[device]: only an f-string written inside the
    call was read. torch.accelerator.set_device_index(rank) is a GPU slot too."""
    from ddp_tutorial.harness.lint import lint_source

    source = (
        "rank = int(os.environ['RANK'])\n"
        "device = f'cuda:{rank}'\n"
        "torch.cuda.set_device(device)\n"
        "model = DDP(model.to(device), device_ids=[device])\n"
        "torch.accelerator.set_device_index(rank)\n"
        "local = torch.device('cuda', int(os.environ['LOCAL_RANK']))\n"
        "x = x.to(local)\n"
    )
    lines = sorted({f.line for f in lint_source(source) if f.code == "DDP102"})
    assert lines == [3, 4, 5], lines


def test_a_load_of_rank_0s_file_is_judged_by_who_loads_it_and_what_waits_between():
    """DDP127 only where a rank other than the writer reads the written file before any
    collective: rank 0 reading its own file back, another file, or a load after an
    all_reduce rank 0 joins once its save returned, is no finding; a load in the other ranks'
    branch, or under another test, is one."""
    save = "rank = dist.get_rank()\nif rank == 0:\n    torch.save(state, 'ck.pt')\n"
    quiet = [
        "if rank == 0:\n    back = torch.load('ck.pt', map_location='cpu')\n",
        "other = torch.load('init.pt', map_location='cpu')\n",
        "dist.all_reduce(t)\nstate = torch.load('ck.pt', map_location='cpu')\n",
        "dist.barrier()\nstate = torch.load(f='ck.pt', map_location='cpu')\n",
        # helper 86: a barrier in this file's helper (detectron2's synchronize()), Accelerate's
        # wait, DDP's constructor (a broadcast); rank 0 under a test written another way
        "synchronize()\nstate = torch.load('ck.pt', map_location='cpu')\n",
        "accelerator.wait_for_everyone()\nstate = torch.load('ck.pt', map_location='cpu')\n",
        "model = DDP(net)\nstate = torch.load('ck.pt', map_location='cpu')\n",
        "if dist.get_rank() == 0:\n    back = torch.load('ck.pt', map_location='cpu')\n",
    ]
    save = "def synchronize():\n    dist.barrier()\n" + save
    for after in quiet:
        assert "DDP127" not in codes(save + after), after
    flagged = [
        "else:\n    state = torch.load('ck.pt', map_location='cpu')\n",
        "if rank != 0:\n    state = torch.load('ck.pt', map_location='cpu')\n",
        "state = torch.load(f='ck.pt', map_location='cpu')\n",
    ]
    for after in flagged:
        assert codes(save + after).count("DDP127") == 1, after


# Helper 84 ran lint on 19 public training scripts (DINO, MAE, DeiT, ConvNeXt, DiT, llm.c,
# SimSiam, timm, ...): 20 of its 38 findings were false. Each pattern, cut down, and a small
# edit of it that makes the mistake real (still found).
PUBLIC_CASES: dict[str, tuple[str, list[str], str, str, list[str]]] = {
    # name: (correct code, its codes, old, new: the mistake, the mistake's codes)
    "state_dict before the wrap (ConvNeXt, DeiT)": (
        """
        model = Net()
        own = model.state_dict()
        model = DDP(model)
        print(model.module)
        """,
        [],
        "own = model.state_dict()\n        model = DDP(model)",
        "model = DDP(model)\n        own = model.state_dict()",
        ["DDP107"],
    ),
    "a forward before the wrap (llm.c)": (
        """
        model = Net()
        if dist.get_rank() == 0:
            print(model(x))
        model = DDP(model)
        print(model.module)
        """,
        [],
        "            print(model(x))\n        model = DDP(model)",
        "            pass\n        model = DDP(model)\n        if dist.get_rank() == 0:\n"
        "            print(model(x))",
        ["DDP101"],
    ),
    "a checkpoint resumed into the same wrapper (Barlow Twins, SimSiam, VICReg)": (
        """
        model = DDP(net)
        model.load_state_dict(torch.load("ck.pt", map_location="cpu"))
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), "ck.pt")
        """,
        [],
        'model.load_state_dict(torch.load("ck.pt", map_location="cpu"))',
        "print(model.module)",
        ["DDP107"],
    ),
    "resumed through a helper (DINO)": (
        """
        student = DDP(net)
        restart_from_checkpoint("ck.pt", student=student)
        if dist.get_rank() == 0:
            torch.save({"student": student.state_dict()}, "ck.pt")
        """,
        [],
        'restart_from_checkpoint("ck.pt", student=student)',
        "print(student.module)",
        ["DDP107"],
    ),
    "the old launcher named in a comment (DINO)": (
        """
        # launched with torch.distributed.launch or torchrun: both set LOCAL_RANK
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        """,
        [],
        "# launched with torch.distributed.launch",
        "print('torch.distributed.launch')  #",
        ["DDP113"],
    ),
    "--local_rank kept beside LOCAL_RANK (Swin, timm)": (
        """
        parser.add_argument("--local_rank", type=int, default=0)
        local_rank = int(os.environ["LOCAL_RANK"])
        """,
        [],
        'int(os.environ["LOCAL_RANK"])',
        "args.local_rank",
        ["DDP113"],
    ),
    "rank % gpus per node as the GPU (DiT)": (
        """
        rank = dist.get_rank()
        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        """,
        [],
        "rank % torch.cuda.device_count()",
        "rank",
        ["DDP102"],
    ),
    "None-ness every rank shares (llm.c)": (
        """
        dist.init_process_group("gloo")
        val = data[dist.get_rank()::2] if len(sys.argv) > 1 else None
        model = DDP(net)
        if step % 10 == 0 and val is not None:
            model(val)
        dist.destroy_process_group()
        """,
        [],
        "if len(sys.argv) > 1",
        "if dist.get_rank() == 0",
        ["DDP101"],
    ),
    "set_device on the other side of an if (SimSiam)": (
        """
        def worker(gpu, distributed):
            if distributed:
                net.cuda(gpu)
            else:
                torch.cuda.set_device(gpu)
        """,
        [],
        "            else:\n",
        "            if True:\n",
        ["DDP110"],
    ),
    # helper 114: DINO, MAE, ConvNeXt, timm: declared for old launch commands, never read here,
    # the group joined by a helper that reads LOCAL_RANK from the environment
    "an unread --local_rank beside an init_distributed helper (DINO)": (
        """
        parser.add_argument("--local_rank", default=0, type=int, help="Please ignore")
        args = parser.parse_args()
        utils.init_distributed_mode(args)
        """,
        [],
        "utils.init_distributed_mode(args)",
        "utils.init_distributed_mode(args)\n        torch.cuda.set_device(args.local_rank)",
        ["DDP113"],  # read here: under torchrun it stays 0 on every rank
    ),
    "a load without map_location where the other branch has one (pytorch/examples imagenet)": (
        """
        if args.gpu is None:
            checkpoint = torch.load(args.resume)
        else:
            checkpoint = torch.load(args.resume, map_location=f"cuda:{args.gpu}")
        """,
        [],
        'torch.load(args.resume, map_location=f"cuda:{args.gpu}")',
        "torch.load(args.resume)",
        ["DDP108", "DDP108"],
    ),
    # helper 114: MoCo v3 and SimSiam join (backend from a flag), then barrier, then set_device
    "a barrier before set_device on a group that may be nccl runs on cuda:0 (MoCo v3)": (
        """
        def main_worker(gpu, args):
            dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url)
            torch.cuda.set_device(gpu)
            torch.distributed.barrier()
            if args.gpu is not None:
                torch.cuda.set_device(args.gpu)
        """,
        [],
        "            torch.cuda.set_device(gpu)\n            torch.distributed.barrier()\n",
        "            torch.distributed.barrier()\n            torch.cuda.set_device(gpu)\n",
        ["DDP110"],  # once: the first set_device after it
    ),
    "a barrier before set_device on a gloo group uses no GPU": (
        """
        def main_worker(gpu, args):
            dist.init_process_group("gloo")
            torch.cuda.set_device(gpu)
            torch.distributed.barrier()
        """,
        [],
        "            torch.cuda.set_device(gpu)\n            torch.distributed.barrier()\n",
        "            torch.distributed.barrier()\n            torch.cuda.set_device(gpu)\n",
        [],
    ),
    "a save behind rank % gpus per node: one writer per node (imagenet, SimSiam)": (
        """
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        if rank == 0:
            torch.save(state, "checkpoint.pth")
        """,
        [],
        "if rank == 0:",
        "if rank % ngpus_per_node == 0:",
        ["DDP106"],
    ),
    # helper 87, 25 more public scripts
    "a test of whether a launcher ran it, by a name (yolov5's early stop)": (
        """
        RANK = int(os.getenv("RANK", -1))
        dist.init_process_group("gloo")
        if RANK != -1:
            dist.broadcast_object_list(stop, 0)
        dist.destroy_process_group()
        """,
        [],
        "if RANK != -1:",
        "if RANK != 0:",
        ["DDP101"],
    ),
    "a module's function named like one of this file's (guided-diffusion's save; helper 89)": (
        """
        import torch as th
        from mylib import ckpt
        class Loop:
            def save(self):
                if dist.get_rank() == 0:
                    th.save(state, "model.pt")
                    ckpt.save(state, "copy.pt")
                dist.barrier()
        """,
        [],
        'th.save(state, "model.pt")',
        "self.save()",
        ["DDP101"],
    ),
    "a DistributedSampler inside an if in the DataLoader call, told through it (flow)": (
        """
        loader = DataLoader(data, sampler=DistributedSampler(data) if ddp else None)
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            for x in loader:
                pass
        """,
        [],
        "            loader.sampler.set_epoch(epoch)\n",
        "",
        ["DDP103"],
    ),
    "an evaluation's DistributedSampler, shuffling but harmless (retinanet)": (
        """
        test_sampler = DistributedSampler(test_set)
        loader = DataLoader(test_set, sampler=test_sampler)
        """,
        [],
        "test_sampler",
        "train_sampler",
        ["DDP103"],
    ),
    "the rank read from a copy of the environment (pytorch/examples' ddp example)": (
        """
        env_dict = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        rank, local_rank = int(env_dict["RANK"]), int(env_dict.get("LOCAL_RANK"))
        torch.accelerator.set_device_index(local_rank)
        """,
        [],
        "set_device_index(local_rank)",
        "set_device_index(rank)",
        ["DDP102"],
    ),
    "an evaluation loader's sampler made in its DataLoader call (helper 89)": (
        """
        test_loader = DataLoader(test_set, sampler=DistributedSampler(test_set))
        """,
        [],
        "test_loader",
        "train_loader",
        ["DDP103"],
    ),
    "a CPU tensor behind .int() and an if, broadcast on nccl (yolov7)": (
        """
        dist.init_process_group("nccl")
        indices = (torch.tensor(idx) if rank == 0 else torch.zeros(n)).int().to(device)
        dist.broadcast(indices, 0)
        """,
        [],
        ".int().to(device)",
        ".int()",
        ["DDP128"],
    ),
    # the twentieth session, the rest of helper 87's verdicts
    "a save behind a flag set from is_master() (open_clip)": (
        """
        dist.init_process_group("gloo")
        args.save_logs = args.logs and is_master(args)
        if args.save_logs:
            torch.save(state, "epoch.pt")
        """,
        [],
        " and is_master(args)",
        "",
        ["DDP105"],
    ),
    "a save behind a helper that answers False off the main rank (TAPE)": (
        """
        dist.init_process_group("gloo")
        is_master = dist.get_rank() == 0
        def do_save(epoch):
            if not is_master:
                return False
            return epoch % 5 == 0
        for epoch in range(3):
            if do_save(epoch):
                torch.save(state, "epoch.pt")
        """,
        [],
        "if not is_master:",
        "if epoch < 0:",
        ["DDP105"],
    ),
    "a branch on metrics of a model on this rank's GPU is no rank test (DLRM)": (
        """
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        model = Net().to(device)
        is_best = evaluate(model, device) > best
        if is_best and dist.get_rank() == 0:
            torch.save(model.state_dict(), "best.pt")
        """,
        [],
        " and dist.get_rank() == 0",
        "",
        ["DDP105"],
    ),
    # from a twenty-fifth-session review of 35 public files (helper 126)
    "a save guarded by the GPU index that is the rank (the official series' multigpu.py)": (
        """
        from torch.nn.parallel import DistributedDataParallel as DDP
        class Trainer:
            def __init__(self, model, gpu_id):
                self.gpu_id = gpu_id
                self.model = DDP(model.to(gpu_id), device_ids=[gpu_id])
            def _save_checkpoint(self, epoch):
                torch.save(self.model.module.state_dict(), "checkpoint.pt")
            def train(self, max_epochs):
                for epoch in range(max_epochs):
                    if self.gpu_id == 0 and epoch % 10 == 0:
                        self._save_checkpoint(epoch)
        """,
        ["DDP123"],  # (true: the last epochs are never saved)
        "                    if self.gpu_id == 0 and epoch % 10 == 0:",
        "                    if epoch % 10 == 0:",
        ["DDP105", "DDP123"],
    ),
    "a save in a function nested in a helper its callers guard (MLPerf GNMT)": (
        """
        class Trainer:
            def save(self, name):
                def write_checkpoint(state, filename):
                    torch.save(state, filename)
                write_checkpoint({"step": 1}, name)
            def run(self):
                dist.init_process_group("gloo")
                if dist.get_rank() == 0:
                    self.save("last.pt")
        """,
        [],
        "                if dist.get_rank() == 0:\n                    self.save",
        "                if True:\n                    self.save",
        ["DDP105"],
    ),
    "a load of this rank's own file, saved from its own GPU (swav's queue)": (
        """
        dist.init_process_group("nccl")
        queue_path = os.path.join("dump", "queue" + str(dist.get_rank()) + ".pth")
        queue = torch.load(queue_path)["queue"]
        """,
        [],
        '"queue" + str(dist.get_rank()) + ".pth"',
        '"queue.pth"',
        ["DDP108"],
    ),
    "the global rank as the index of another accelerator (mmengine's MUSA branch)": (
        """
        dist.init_process_group("nccl")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.musa.set_device(local_rank)
        """,
        [],
        "torch.musa.set_device(local_rank)",
        "torch.musa.set_device(dist.get_rank())",
        ["DDP102"],
    ),
    "a download in a context manager that lets rank 0 go first (YOLOv7)": (
        """
        from utils.torch_utils import torch_distributed_zero_first
        dist.init_process_group("nccl")
        attempt_download("yolov7.pt")
        with torch_distributed_zero_first(int(os.environ["LOCAL_RANK"])):
            model = load("yolov7.pt")
        """,
        [],
        """attempt_download("yolov7.pt")
        with torch_distributed_zero_first(int(os.environ["LOCAL_RANK"])):""",
        """with torch_distributed_zero_first(int(os.environ["LOCAL_RANK"])):
            attempt_download("yolov7.pt")""",
        ["DDP122"],
    ),
    "a checkpoint loaded into the plain model, then wrapped and saved (MLPerf SSD)": (
        """
        model = Net()
        model.load_state_dict(torch.load("ck.pt", map_location="cpu"))
        model = DDP(model)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "ck.pt")
        """,
        [],
        "model.module.state_dict()",
        "model.state_dict()",
        ["DDP107"],
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_CASES))
def test_the_false_findings_of_public_scripts_are_gone_and_the_mistakes_still_found(name):
    good, good_codes, old, new, bad_codes = PUBLIC_CASES[name]
    assert old in good, "the edit applies"
    ignored = {"DDP111", "DDP109"}  # the cut-down cases neither destroy nor set a device

    def found(source: str) -> list[str]:
        return [c for c in codes(source) if c not in ignored]

    assert found(good) == good_codes, "a false finding"
    assert found(good.replace(old, new)) == bad_codes, "the mistake is no longer found"


def test_the_reviews_variants_of_the_new_logic_helper_86():
    """A name that merely holds "load" (log_upload, a DataLoader) is no resume (DDP107 stays);
    a name set to a value only in a rank branch is None on the others (DDP101); a form feed
    in a file no longer moves the comments that lint ignores (DDP113 read them as code)."""
    wrapped = "model = DDP(net)\nlog_upload(model)\nif dist.get_rank() == 0:\n"
    assert "DDP107" in codes(wrapped + '    torch.save(model.state_dict(), "w.pt")\n')
    branch = 'dist.init_process_group("gloo")\nrank = dist.get_rank()\ny = None\n'
    branch += "if rank == 0:\n    y = t\nif y is not None:\n    dist.all_reduce(y)\n"
    assert "DDP101" in codes(branch + "dist.destroy_process_group()\n")
    fed = "x = 1\n\x0c\n# torch.distributed.launch was the old way\ny = 2\n"
    assert codes(fed) == []


def test_a_cpu_tensor_in_an_nccl_collective_is_found_however_it_was_made():
    """DDP128 for a tensor the factories made without device=, directly or by name, or
    moved with .cpu(); not where the group also has a CPU backend, the tensor was moved to
    the GPU since, the default device is a GPU, or the collective pickles objects."""
    init = 'dist.init_process_group(backend="nccl", device_id=device)\n'
    found = {
        "direct": "dist.all_reduce(torch.zeros(2))",
        "moved back": "t = loss.detach().cpu()\ndist.broadcast(t, src=0)",
        "all_gather's outputs": "outs = [torch.empty(3) for _ in range(world)]\n"
        "dist.all_gather(outs, x)",
        "in a function": "def mean(v):\n    t = torch.tensor([v, 1.0])\n"
        "    dist.all_reduce(t)\n    return t[0] / t[1]",
        "by keyword": "t = torch.ones(1)\ndist.all_reduce(tensor=t)",
    }
    for label, body in found.items():
        assert codes(init + body).count("DDP128") == 1, label
    clean = {
        "on the device": "dist.all_reduce(torch.zeros(2, device=device))",
        "moved since": "t = torch.tensor([1.0])\nt = t.to(device)\ndist.all_reduce(t)",
        "made on the device": "t = torch.tensor([1.0]).cuda()\ndist.all_reduce(t)",
        "objects": "out = [None] * 2\ndist.all_gather_object(out, torch.tensor(1))",
        "default device": "torch.set_default_device(device)\n"
        "t = torch.zeros(1)\ndist.all_reduce(t)",
        "entered device": "with torch.device(device):\n    t = torch.zeros(1)\ndist.all_reduce(t)",
    }
    for label, body in clean.items():
        assert "DDP128" not in codes(init + body), label
    for backend in ('"gloo"', '"cpu:gloo,cuda:nccl"', "args.backend", ""):
        source = f"dist.init_process_group({backend})\ndist.all_reduce(torch.zeros(2))"
        assert "DDP128" not in codes(source), backend
    # helper 89: correct code it flagged
    also_clean = {
        "gloo where there is no GPU": "if torch.cuda.is_available():\n"
        "    dist.init_process_group('nccl')\n    t = torch.ones(1, device=device)\nelse:\n"
        "    dist.init_process_group('gloo')\n    t = torch.ones(1)\ndist.all_reduce(t)",
        "a gloo side group": "dist.init_process_group('nccl')\ncpu = dist.new_group(backend='gloo')"
        "\nt = torch.ones(1)\ndist.all_reduce(t, group=cpu)",
        "a group of its own": init + "t = torch.ones(1)\ndist.all_reduce(t, group=pg)",
        "device in **kwargs": init + "t = torch.zeros(2, **on_gpu)\ndist.all_reduce(t)",
        "moved in a tuple": init + "t = torch.ones(1)\nt, n = t.to(device), 3\ndist.all_reduce(t)",
        "a default tensor type": init + "torch.set_default_tensor_type('torch.cuda.FloatTensor')\n"
        "t = torch.ones(1)\ndist.all_reduce(t)",
        "one branch moves it": init + "if big:\n    t = torch.ones(1, device=device)\nelse:\n"
        "    t = torch.ones(1)\ndist.all_reduce(t)",
    }
    for label, source in also_clean.items():
        assert "DDP128" not in codes(source), label


def test_the_hand_made_prefix_edits_behind_a_guard_and_beside_it_helper_102():
    """lstrip is wrong behind a startswith guard too; replace everywhere is wrong behind one
    unless it replaces once; replacing torch.compile's _orig_mod. inside keys is right, and a
    loop over named_modules() holds no checkpoint keys."""
    flagged = {
        "if k.startswith('module.'):\n        k = k.lstrip('module.')": "DDP124",
        "k = k.lstrip('module.') if k.startswith('module.') else k": "DDP124",
        "if k.startswith('module.'):\n        k = k.replace('module.', '')": "DDP129",
        "k = k.replace('module.', '') if k.startswith('module.') else k": "DDP129",
        "k = k.replace('module.', 'backbone.')": "DDP129",
    }
    for edit, code in flagged.items():
        found = codes(f"for k, v in state.items():\n    {edit}\n    plain[k] = v\n")
        assert code in found, (edit, found)
    clean = [
        "for k, v in state.items():\n    if k.startswith('module.'):\n"
        "        k = k.replace('module.', '', 1)\n    plain[k] = v\n",
        "for k, v in state.items():\n    plain[k.replace('_orig_mod.', '')] = v\n",
        "for name, m in model.named_modules():\n    print(name.replace('module.', ''))\n",
    ]
    for source in clean:
        assert not {"DDP124", "DDP129"} & set(codes(source)), source
    message = lint_source("for k, v in state.items():\n    d[k.replace('module.', 'b.')] = v\n",
                          "x.py")[0].message  # fmt: skip
    assert message.startswith("k.replace('module.', 'b.') replaces"), message


def test_a_device_made_from_the_local_rank_places_values_and_splits_tests_on_itself():
    """Helper 97's read of the DLRM change: an attribute holding the device (args.device,
    self.device) places values as a name does; the usual DDP(..., device_ids=[local_rank])
    too; but a test on the device itself (`device.index == 0`) still runs on some ranks."""
    head = 'dist.init_process_group("nccl")\nlocal = int(os.environ["LOCAL_RANK"])\n'
    save = 'if is_best:\n    torch.save(model.state_dict(), "best.pt")\n'
    for device in ("device", "args.device"):
        placed = f'{device} = torch.device("cuda", local)\nmodel = Net().to({device})\n'
        source = head + placed + f"is_best = evaluate(model, {device}) > best\n" + save
        assert "DDP105" in codes(source), device
    wrapped = 'device = torch.device("cuda", local)\n'
    wrapped += "model = DDP(Net().to(device), device_ids=[local])\n"
    source = head + wrapped + "is_best = evaluate(model, device) > best\n" + save
    assert "DDP105" in codes(source.replace("model.state_dict", "model.module.state_dict"))
    tested = head + 'device = torch.device("cuda", local)\nif device.index == 0:\n'
    assert "DDP101" in codes(tested + "    dist.barrier()\n")
    trainer = """
        class Trainer:
            def __init__(self):
                self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
                self.model = DDP(Net().to(self.device), device_ids=[self.device])

            def step(self, x):
                loss = self.model(x.to(self.device)).sum()
                if loss.item() > 1:
                    dist.barrier()
        """
    assert "DDP101" not in codes(head + textwrap.dedent(trainer)), "the loss is every rank's"


def test_a_chosen_init_timeout_and_a_dataparallel_fallback_are_not_flagged():
    """Helper 138, on yolov5's train.py: rank 0 downloading while the others wait is fine when
    init_process_group was given a timeout of its own (its 3 hours); and nn.DataParallel in a
    file that wraps with a DDP helper of its own (smart_DDP) is a fallback without torchrun."""
    slow = (
        "import torch.distributed as dist\n"
        'dist.init_process_group("gloo"{})\nif dist.get_rank() == 0:\n    download(url)\n'
        "dist.barrier()\ndist.destroy_process_group()\n"
    )
    assert codes(slow.format("")) == ["DDP122"]
    assert codes(slow.format(", timeout=timedelta(seconds=10800)")) == []
    fallback = (
        "import torch\nimport torch.distributed as dist\n"
        "if RANK == -1:\n    model = torch.nn.DataParallel(model)\n"
        'else:\n    dist.init_process_group("nccl")\n    model = smart_DDP(model)\n'
        "dist.destroy_process_group()\n"
    )
    assert "DDP116" not in codes(fallback)
    assert "DDP116" in codes("import torch\nmodel = torch.nn.DataParallel(model)\n")
