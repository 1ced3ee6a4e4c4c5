"""Shared fixtures: paths, the GPU skip, a guard against leaked processes and unmarked launches."""

from __future__ import annotations

import importlib.machinery
import itertools
import os
import random
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

pytest_plugins = ["pytester"]  # tests/test_leak_guard.py runs the guards on tests that leak

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"  # what a user copies and runs
DEMOS = SCRIPTS / "demos"  # the lessons' demonstration scripts


def load_script(name: str) -> ModuleType:
    """``scripts/<name>`` imported as a module: its functions run here, without a launch."""
    from ddp_tutorial.lessons.speed import script_module

    return script_module(SCRIPTS / name)


def gpu_view() -> tuple[int, str]:
    """``(GPUs CUDA will show the ranks, why none)``, via NVML: no CUDA in the test process.

    A setup the course refuses (MIG) counts as no GPU, with the refusal as the
    reason: collection must never crash on it.
    """
    from ddp_tutorial.devices import DeviceError, visible_gpu_count

    try:
        count = visible_gpu_count()
    except DeviceError as exc:
        return 0, str(exc)
    return count, "" if count else "none visible via NVML"


def gpu_count() -> int:
    """Visible GPUs (see :func:`gpu_view`)."""
    return gpu_view()[0]


# `make test` runs two pytest-xdist workers: the suite waits more than it computes (launch
# start-up, rendezvous, the exercises' hang timeouts: 123 % of one core on average over a
# serial run), so a second worker fills the idle core. A group runs whole on one worker:
# each test file (its module fixtures are set up once), the lesson notebooks in two halves
# (each half one after another, as `make run` executes them) and every exercise test (they
# share one session batch of launches). The long groups go first, then the files that
# launch, so that the short files fill in at the end and both workers end together.
# (xdist's own --dist loadgroup cannot do this with pytest 9: the group it appends to a
# node id is lost, since pytest 9 derives node ids; so the scheduler below groups by id.)
FIRST_GROUPS = ("notebooks 07-12", "exercises", "notebooks 00-06")
# Then the longest files that launch (seconds on one worker of a two-worker run, 2026-12-02:
# 60, 28, 27, 22, 20, 19): given last, test_training.py alone kept one worker busy for a
# minute after the other had finished.
LONG = ("training", "launch", "template_copy", "gpu_readiness", "compare", "checkpoint")
LONG_FILES = tuple(f"tests/test_{name}.py" for name in LONG)


def group_order(group: str, launches: bool) -> tuple[int, bool]:
    """Where a group runs in `make test`: the long ones first, then the rest of those that
    launch, then the quick ones (in collection order within each)."""
    ranked = FIRST_GROUPS + LONG_FILES
    return (ranked.index(group) if group in ranked else len(ranked)), not launches


def suite_group(nodeid: str) -> str:
    """The group of a test (by its node id) under `make test`'s workers (see above)."""
    path, _, name = nodeid.partition("::")
    if name.startswith("test_notebook_executes["):
        lesson = int(name.removeprefix("test_notebook_executes[")[:2])
        return "notebooks 07-12" if lesson >= 7 else "notebooks 00-06"
    if Path(path).name.startswith("test_exercises"):
        return "exercises"
    return path


def group_scheduling() -> type:
    """xdist's scope scheduler over :func:`suite_group`'s groups (imported here: a GPU box may
    have no xdist). A worker that crashes does not take its test along to the next worker:
    xdist's own ``remove_node`` puts the test the worker died on back in the queue with the
    rest of its group, so a test that kills its process killed every replacement in turn
    until xdist stopped replacing them, and the tests after it in the group never ran
    (pytest-xdist PR 1371, open). It is reported failed once; the rest of the group runs."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return suite_group(nodeid)

        def remove_node(self, node: object) -> str | None:
            workload = self.assigned_work.pop(node)
            pending = [(u, i) for u in workload.values() for i, done in u.items() if not done]
            if not pending:
                return None
            unit, crashed = pending[0]
            unit[crashed] = True  # reported by xdist as the crash; never started again
            self.workqueue.update((k, u) for k, u in workload.items() if not all(u.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return GroupScheduling


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a GPU box may not have
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    config.option.loadscopereorder = False  # in collection order: the long groups first
    return group_scheduling()(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    launching = {suite_group(item.nodeid) for item in items if "torchrun" in item.keywords}

    def order(item: pytest.Item) -> tuple[int, bool]:  # a stable sort: else as collected
        group = suite_group(item.nodeid)
        return group_order(group, group in launching)

    items.sort(key=order)
    count, why = gpu_view()
    if count > 0:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({why})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker launches into its own runs folder: two workers naming runs of the same
    script in the same second, or pruning each other's old runs, would share folders."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and "DDP_TUTORIAL_RUNS" not in os.environ:
        os.environ["DDP_TUTORIAL_RUNS"] = str(REPO / "runs" / f"pytest-{worker}")


def processes_running(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``marker`` (the package's own check)."""
    from ddp_tutorial.harness.processes import matching

    return matching(marker)


def _starts_an_interpreter(args: object) -> bool:
    """Whether a command line would start Python (a rank, a script, a Jupyter kernel)."""
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not words:
        return False
    program = os.path.basename(words[0])
    return (
        words[0] == sys.executable
        or program.startswith("python")
        or program in ("torchrun", "jupyter", "ddp-tutorial")
    )


TEST_ID_ENV = "DDP_TUTORIAL_TEST_ID"
# Set by torch itself on first use (the first torch.compile): restored, not a test's leak.
TORCH_SETS = {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTEST_CURRENT_TEST"}
PROCESS_GRACE_S = 10.0  # how long a process a test started may take to end after it
_test_ids = itertools.count()


# A handler a test installs in this process (the template's StopCheck takes SIGTERM and SIGUSR1)
# would decide what a later signal does: pytest's own SIGINT, a CI's SIGTERM. Not SIGCHLD:
# torch's DataLoader sets its handler once per process and remembers that it did.
GUARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _processes_of(test_id: str, before: set[int]) -> list[psutil.Process]:
    """Live processes not in ``before`` whose environment carries ``test_id``.

    Every process a test starts inherits the id, also those that outlive their
    launcher and are reparented to init (which ``children()`` would miss).
    """
    found = []
    for pid in set(psutil.pids()) - before:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(TEST_ID_ENV) == test_id and not _own_service(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


MP_SERVICES = ("from multiprocessing.forkserver import", "from multiprocessing.resource_tracker")


def _own_service(proc: psutil.Process) -> bool:
    """This process's own multiprocessing fork server or resource tracker (the template's
    DataLoader workers start from one): one per process, ended by its owner's exit, not a
    test's leftover."""
    command = " ".join(proc.cmdline())
    return proc.ppid() == os.getpid() and any(m in command for m in MP_SERVICES)


def _torch_switches() -> dict[str, object]:
    """Process-wide torch settings a test (or the template's ``main()``) may flip.

    ``scripts/train.py`` sets ``cudnn.benchmark``; ``--deterministic`` the other
    three: each would change what the next test in this process runs.
    """
    import torch

    return {
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.are_deterministic_algorithms_enabled()": (
            torch.are_deterministic_algorithms_enabled()
        ),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
    }


def _set_torch_switches(saved: dict[str, object]) -> None:
    """Put back the switches that differ from ``saved`` (only those: the deterministic
    setter imports torch._inductor)."""
    import torch

    now = _torch_switches()
    setters = {
        "torch.backends.cudnn.benchmark": lambda v: setattr(torch.backends.cudnn, "benchmark", v),
        "torch.backends.cudnn.deterministic": (
            lambda v: setattr(torch.backends.cudnn, "deterministic", v)
        ),
        "torch.are_deterministic_algorithms_enabled()": torch.use_deterministic_algorithms,
        "torch.get_float32_matmul_precision()": torch.set_float32_matmul_precision,
    }
    for name, value in saved.items():
        if now[name] != value:
            setters[name](value)


class _Baseline:
    """The environment, torch's switches, signal handlers and the process table, before a scope.

    ``leaks()`` puts back what changed and says what it was: the caller fails with it.
    Processes started meanwhile carry ``scope_id`` in their environment.
    """

    def __init__(self, scope_id: str) -> None:
        self.scope_id = scope_id
        self.env = dict(os.environ)
        self.switches = _torch_switches()
        self.pids = set(psutil.pids())
        self.handlers = {sig: signal.getsignal(sig) for sig in GUARDED_SIGNALS}
        os.environ[TEST_ID_ENV] = scope_id

    def leaks(self) -> list[str]:
        os.environ.pop(TEST_ID_ENV, None)
        env = {k: v for k, v in self.env.items() if k != TEST_ID_ENV}
        changed = sorted(
            k
            for k in set(env) | set(os.environ)
            if env.get(k) != os.environ.get(k) and k not in TORCH_SETS
        )
        os.environ.clear()
        os.environ.update(self.env)
        now = _torch_switches()
        flipped = [
            f"{k} {self.switches[k]!r} -> {now[k]!r}" for k in now if now[k] != self.switches[k]
        ]
        _set_torch_switches(self.switches)
        handlers = [f"{sig.name} {h!r} -> {signal.getsignal(sig)!r}"
                    for sig, h in self.handlers.items() if signal.getsignal(sig) != h]  # fmt: skip
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        deadline = time.monotonic() + PROCESS_GRACE_S
        left = _processes_of(self.scope_id, self.pids)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _processes_of(self.scope_id, self.pids)
        names = []
        for proc in left:
            try:
                names.append(" ".join(proc.cmdline()[:4]))
                proc.kill()
            except psutil.Error:  # gone, or a zombie, since
                continue
        problems = []
        if changed:
            problems.append(f"changed environment variables {changed}")
        if flipped:
            problems.append(f"changed torch settings {flipped}")
        if handlers:
            problems.append(f"left signal handlers installed for {handlers}")
        if left:
            problems.append(f"left {len(left)} processes running: {names}")
        return problems


@pytest.fixture(scope="module", autouse=True)
def _no_module_leaks(request: pytest.FixtureRequest):
    """What the module-scoped fixtures of a test file start and set, checked at its end.

    Autouse fixtures are set up before the other fixtures of their scope, so a
    module fixture's launches (test_training.py's ``runs``) carry this module's id:
    a process of theirs still alive when the module's fixtures are torn down, an
    environment variable or a torch switch they changed, fails the module's last
    test (at teardown).
    """
    baseline = _Baseline(f"{os.getpid()}-module-{next(_test_ids)}")
    yield
    problems = baseline.leaks()
    if problems:
        pytest.fail(
            f"{request.node.nodeid} (module fixtures) " + "; ".join(problems) + " (restored)"
        )


@pytest.fixture(autouse=True)
def _no_leaks(_no_module_leaks: None, request: pytest.FixtureRequest):
    """A test leaves the environment, torch's switches, the global RNGs, the signal handlers
    and the process table as it found them.

    The global RNG states of torch, numpy and ``random`` are restored (building
    a layer draws from them; a test that reseeds them must not decide what the
    next test draws). Environment variables it set or removed, and torch switches
    it flipped (``cudnn.benchmark``, deterministic algorithms), are restored, and a
    process it started that is still alive ``PROCESS_GRACE_S`` after the test is
    killed: either fails the test, since the next test would otherwise run in a
    state it did not ask for (a leaked ``CUBLAS_WORKSPACE_CONFIG``, a torchrun tree).
    It runs after the module's fixtures are set up (it requests the module guard),
    so it sees what the test itself does.
    """
    import numpy as np
    import torch

    rngs = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    baseline = _Baseline(f"{os.getpid()}-{next(_test_ids)}")
    yield
    torch.set_rng_state(rngs[0])
    np.random.set_state(rngs[1])
    random.setstate(rngs[2])
    problems = baseline.leaks()
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems) + " (restored)")


@pytest.fixture(autouse=True)
def _only_marked_tests_launch(
    _no_leaks: None, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    """A test that starts torchrun, a Python interpreter or a kernel must say so.

    ``@pytest.mark.torchrun`` (or ``notebook``, ``gpu``): ``make test-fast``
    leaves those out, and this keeps the markers honest, so the edit loop never
    pays for a launch or an ``import torch`` in a new process that it did not
    ask for. Every new process goes through ``Popen._execute_child``, also a
    kernel that jupyter_client starts with its own ``Popen``.

    It requests :func:`_no_leaks` first, by name, so that the leak guard is set up
    before ``monkeypatch`` and torn down after it: what a test set with
    ``monkeypatch.setenv`` is undone before the guard compares the environment.
    Renaming either fixture keeps that order (tests/test_leak_guard.py renames them).
    """
    if any(request.node.get_closest_marker(m) for m in ("torchrun", "notebook", "gpu")):
        return
    import subprocess

    from ddp_tutorial.harness import processes

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts torchrun: mark it @pytest.mark.torchrun"
        )

    monkeypatch.setattr(processes, "spawn", refuse)
    real = subprocess.Popen._execute_child

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        if _starts_an_interpreter(args):
            raise AssertionError(
                f"{request.node.nodeid} starts a Python process ({args!r}): mark it "
                "@pytest.mark.torchrun (or make the test pure)"
            )
        return real(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)


@pytest.fixture
def write_script(tmp_path: Path):
    """Write a small script into tmp_path and return its path."""

    def write(name: str, body: str) -> Path:
        path = tmp_path / name
        path.write_text(body)
        return path

    return write


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


# -- a fake NVML: this machine has no driver -------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_gpu(
    index: int,
    uuid: str | None = None,
    name: str = "H100",
    mig: bool = False,
    capability: tuple[int, int] | None = (9, 0),
    exclusive: bool = False,
    memory_mib: float = 80_000.0,
):
    """One physical GPU as :func:`fake_pynvml` serves it (80 GB, 1 MiB used, an H100)."""
    from ddp_tutorial.devices import GpuInfo

    uuid = uuid or f"GPU-{index:08d}-aaaa"
    return GpuInfo(index, name, uuid, memory_mib, 1.0, mig=mig, capability=capability,
                   exclusive=exclusive)  # fmt: skip


def fake_pynvml(
    gpus: list | None,
    pids: dict[int, list[int]] | None = None,
    driver_cuda: int = 13000,
    failing: set[str] = frozenset(),
    refused: dict[int, str] | None = None,
    p2p: bool = True,
):
    """A stand-in for the ``pynvml`` module; ``gpus=None``: no driver.

    Utilization of GPU ``i`` is ``10 * i`` %, its memory used ``(i + 1)`` GiB;
    ``failing`` names NVML calls that raise (as MIG and vGPU devices do for
    utilization: "Not Supported"); ``driver_cuda`` is what
    ``nvmlSystemGetCudaDriverVersion`` reports (13000: CUDA 13.0, a driver this torch's
    CUDA 13 build runs on; an older one hides the GPUs from torch); ``refused``
    maps a physical index to the error NVML gives for that one device
    ("Insufficient Permissions": a GPU outside the container's cgroup).
    """
    import types

    mod = types.ModuleType("pynvml")
    mod.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)  # find_spec sees it installed
    mod.NVMLError = FakeNVMLError
    state = {"inits": 0}

    def init():
        if gpus is None:
            raise FakeNVMLError("NVML Shared Library Not Found")
        state["inits"] += 1

    def shutdown():
        state["inits"] -= 1

    def call(name, fn):
        def wrapped(*args):
            if name in failing:
                raise FakeNVMLError("Not Supported")
            return fn(*args)

        return wrapped

    mod.nvmlInit = init
    mod.nvmlShutdown = shutdown
    mod.nvmlDeviceGetCount = lambda: len(gpus)

    def handle(i):
        if refused and i in refused:
            raise FakeNVMLError(refused[i])
        return gpus[i]

    mod.nvmlDeviceGetHandleByIndex = handle
    mod.NVML_P2P_CAPS_INDEX_READ, mod.NVML_P2P_STATUS_OK = 0, 0
    mod.nvmlDeviceGetP2PStatus = lambda a, b, caps: 0 if p2p else 2  # 2: chipset not supported
    mod.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3
    mod.nvmlDeviceGetCudaComputeCapability = call(
        "nvmlDeviceGetCudaComputeCapability", lambda h: h.capability or (9, 0)
    )
    mod.nvmlDeviceGetComputeMode = call(
        "nvmlDeviceGetComputeMode", lambda h: 3 if h.exclusive else 0
    )
    mod.nvmlDeviceGetName = lambda h: h.name.encode()  # old bindings return bytes
    mod.nvmlDeviceGetUUID = lambda h: h.uuid
    mod.nvmlDeviceGetMemoryInfo = call("nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(
        total=int(h.memory_total_mib * 2**20), used=(h.index + 1) * 2**30, free=0))  # fmt: skip
    mod.nvmlDeviceGetUtilizationRates = call(
        "nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(gpu=10 * h.index, memory=0)
    )
    mod.nvmlDeviceGetMigMode = call("nvmlDeviceGetMigMode", lambda h: [int(h.mig), int(h.mig)])
    mod.nvmlSystemGetCudaDriverVersion = lambda: driver_cuda
    mod.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # each process: 256 MiB per pid
        types.SimpleNamespace(pid=p, usedGpuMemory=256 * 2**20 * (k + 1))
        for k, p in enumerate((pids or {}).get(h.index, []))
    ]

    def by_uuid(uuid):
        found = [g for g in gpus if g.uuid == uuid]
        if not found:
            raise FakeNVMLError("Not Found")
        return handle(gpus.index(found[0]))

    mod.nvmlDeviceGetHandleByUUID = by_uuid
    mod.state = state
    return mod


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch):
    """``nvml(gpus, ...)`` installs :func:`fake_pynvml` as ``pynvml`` and returns it."""

    def install(gpus, **kwargs):
        mod = fake_pynvml(gpus, **kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        import torch

        if torch.version.cuda is None:  # a CPU-only torch would see none of the fake GPUs
            monkeypatch.setattr(torch.version, "cuda", "13.0")  # (gpu_plan.torch_sees_no_gpu)
        return mod

    return install


# -- a process group in this process ---------------------------------------------------
KEPT: list[object] = []  # objects still referenced elsewhere when released: never freed


def drop_here(holder: list[object], timeout_s: float = 0.5) -> bool:
    """Take the one object out of ``holder`` and let it go on this thread, once nothing else
    refers to it (False: still referenced after ``timeout_s``; then it is kept for good).

    Why: a process group must be freed on a thread other than its own. PowerSGD's callbacks
    hold the group, and gloo's worker thread releases them just after the step's future is
    marked done; if the test has already destroyed the group and dropped its objects, that
    release is the last reference, the group's destructor runs on the worker thread and joins
    it: "terminate called after throwing an instance of 'std::system_error' / Resource
    deadlock avoided", and the pytest worker aborts a test or two later (reproduced: 2 of 3
    processes of 200 in-process PowerSGD groups aborted; none of 3 x 300 with this). The
    worker lets go within milliseconds; what still holds it after ``timeout_s`` holds it for
    good (after ``init_device_mesh``, a reference no Python object owns: torch's own).
    """
    import gc

    obj = holder.pop()
    deadline = time.monotonic() + timeout_s
    while sys.getrefcount(obj) > 2:  # this name and getrefcount's own argument
        if time.monotonic() > deadline:
            KEPT.append(obj)
            return False
        gc.collect()  # a model or a hook's state in a reference cycle holds it too
        time.sleep(0.005)
    del obj  # the last reference: freed here, now
    return True


@pytest.fixture
def world_of_one():
    """A gloo group of one process on an in-memory store (no port, no launch), freed on this
    thread (:func:`drop_here`)."""
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  before init, or its defaults hold the group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = [dist.group.WORLD]
    try:
        yield
    finally:
        dist.destroy_process_group()
        drop_here(group)


@pytest.fixture
def own_signal_handlers():
    """For a test that runs code installing signal handlers in this process (the template's
    StopCheck): pytest's handlers come back after it, so the leak guard has nothing to find."""
    saved = {sig: signal.getsignal(sig) for sig in GUARDED_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


PER_LAUNCH = 150


@pytest.fixture(scope="session")
def exercise_verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every registered exercise case (tests/exercise_cases.py), checked in one batch.

    The untouched stubs are launched too (``force``): a stub must run to the end and fail
    with a named mistake, not crash.
    """
    from exercise_cases import REGISTERED

    from ddp_tutorial.harness.exercise_check import check_files

    folder = tmp_path_factory.mktemp("exercises")
    pairs = [(case.spec, case.write(folder)) for case in REGISTERED]
    # two launches side by side (about 150 candidates each): the batch mostly waits (hangs'
    # timeouts, the checks' late starts), so the second halves its time for one more start-up
    verdicts = check_files(pairs, force=True, per_launch=PER_LAUNCH)
    return {str(case): v for case, v in zip(REGISTERED, verdicts, strict=True)}
