"""The suite's guards (tests/conftest.py), run on small test files that break them on purpose.

Each case copies this suite's conftest into a scratch folder and runs pytest there in
this process: a test that leaks an environment variable, ``cudnn.benchmark``, a signal
handler or a process must fail, and so must a module fixture that leaves a process running; a test
that sets what it needs through ``monkeypatch`` must pass, whatever the guards are named.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch._inductor.config  # noqa: F401  (see below)

from conftest import KEPT, drop_here

# The inner runs happen in this process, and pytester drops the modules they import when
# they end: torch.use_deterministic_algorithms imports torch._inductor, which registers a
# library once per process. Imported here, it is kept.
CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
FAST = "\nPROCESS_GRACE_S = 0.5  # the copy waits half a second for a leaked process, not 10\n"

LEAKS = {
    "env": "import os\n\ndef test_it():\n    os.environ['DDP_TUTORIAL_LEAKED'] = '1'\n",
    "cudnn": (
        "import torch\n\ndef test_it():\n"
        "    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark\n"
    ),
    "deterministic": (
        "import torch\n\ndef test_it():\n    torch.use_deterministic_algorithms(True)\n"
    ),
    "signal": (
        "import signal\n\ndef test_it():\n"
        "    signal.signal(signal.SIGTERM, lambda signum, frame: None)\n"
    ),
    "process": ("import subprocess\n\ndef test_it():\n    subprocess.Popen(['sleep', '30'])\n"),
    "module fixture process": (
        "import subprocess\nimport pytest\n\n"
        "@pytest.fixture(scope='module')\ndef server():\n"
        "    yield subprocess.Popen(['sleep', '30'])\n\n"
        "def test_one(server):\n    assert server.poll() is None\n\n"
        "def test_two(server):\n    assert server.poll() is None\n"
    ),
    "module fixture env": (
        "import os\nimport pytest\n\n"
        "@pytest.fixture(scope='module')\ndef setting():\n"
        "    os.environ['DDP_TUTORIAL_LEAKED'] = '1'\n\n"
        "def test_one(setting):\n    pass\n"
    ),
}
CLEAN = (
    "import subprocess\nimport torch\n\n"
    "def test_monkeypatched_env_is_not_a_leak(monkeypatch):\n"
    "    monkeypatch.setenv('DDP_TUTORIAL_SET', '1')\n"
    "    monkeypatch.delenv('HOME')\n\n"
    "def test_a_restored_switch_is_not_a_leak():\n"
    "    before = torch.backends.cudnn.benchmark\n"
    "    torch.backends.cudnn.benchmark = not before\n"
    "    torch.backends.cudnn.benchmark = before\n\n"
    "def test_a_process_that_ends_is_not_a_leak():\n"
    "    subprocess.run(['true'], check=True)\n"
)


def run_inner(pytester: pytest.Pytester, conftest: str, test: str) -> pytest.RunResult:
    pytester.makeconftest(conftest + FAST)
    pytester.makepyfile(test_inner=test)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")


@pytest.mark.parametrize("case", LEAKS)
def test_a_test_that_leaks_fails(pytester, case):
    result = run_inner(pytester, CONFTEST, LEAKS[case])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) >= 1, result.stdout.str()
    text = result.stdout.str()
    expected = {
        "env": "changed environment variables ['DDP_TUTORIAL_LEAKED']",
        "cudnn": "changed torch settings ['torch.backends.cudnn.benchmark",
        "deterministic": "changed torch settings ['torch.are_deterministic_algorithms_enabled()",
        "signal": "left signal handlers installed for ['SIGTERM <Handlers.SIG_DFL: 0> -> <function",
        "process": "left 1 processes running: ['sleep 30']",
        "module fixture process": "(module fixtures) left 1 processes running: ['sleep 30']",
        "module fixture env": "(module fixtures) changed environment variables",
    }[case]
    assert expected in text, text[-3000:]
    if case == "module fixture process":  # at the module's end: its last test, not its first
        assert "ERROR at teardown of test_two" in text and "test_one FAILED" not in text, text


def test_what_a_test_restores_passes(pytester):
    result = run_inner(pytester, CONFTEST, CLEAN)
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize(
    "names",
    [("zz_last_guard", "aa_first_launch_guard"), ("aa_first_guard", "zz_last_launch_guard")],
    ids=["guard sorts last", "guard sorts first"],
)
def test_renamed_fixtures_change_nothing(pytester, names):
    """The guard is set up before ``monkeypatch`` because it is requested, not by its name."""
    guard, launch = names
    renamed = re.sub(r"\b_no_leaks\b", guard, CONFTEST)
    renamed = re.sub(r"\b_only_marked_tests_launch\b", launch, renamed)
    assert renamed.count(guard) >= 2 and renamed.count(launch) == 1
    run_inner(pytester, renamed, CLEAN).assert_outcomes(passed=3)
    failed = run_inner(pytester, renamed, LEAKS["env"])
    failed.assert_outcomes(passed=1, errors=1)  # a guard fails a test at its teardown


class _Freed:
    """Records the thread that frees it (as a process group's destructor runs where its last
    reference goes)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __del__(self) -> None:
        self.log.append(f"freed on {threading.current_thread().name}")


def test_drop_here_frees_on_this_thread_after_another_thread_lets_go():
    """world_of_one's teardown: gloo's worker thread still holds the group (PowerSGD's
    callbacks) for a moment after the test's last step; freed there, the process aborts."""
    log: list[str] = []
    box = [_Freed(log)]  # the worker thread's reference
    holder = [box[0]]  # the fixture's

    def worker() -> None:
        time.sleep(0.2)
        log.append("worker let go")
        box.clear()

    thread = threading.Thread(target=worker, name="worker")
    thread.start()
    assert drop_here(holder) and not holder
    thread.join()
    assert log == ["worker let go", f"freed on {threading.current_thread().name}"], log


def test_drop_here_keeps_what_is_still_held_instead_of_waiting_forever():
    log: list[str] = []
    held = _Freed(log)
    assert not drop_here([held], timeout_s=0.05), "someone still holds it: not freed"
    assert KEPT[-1] is held and not log
    KEPT.pop()  # (this test's own object: nothing to keep)
