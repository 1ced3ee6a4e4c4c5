"""Lesson 03's exercise: plausible wrong answers, each named in the lesson's words.

Each case is a small edit of the reference solution (scripts/exercises/solutions/03_rank_gpu.py);
the session fixture checks them all in one batched launch per world size.
"""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

GPU = "03_rank_gpu"
LOCAL = 'local_rank = int(env["LOCAL_RANK"])'
DEVICE = 'device = torch.device("cuda", local_rank)'
PHYSICAL = 'physical = local_rank if listed is None else int(listed.split(",")[local_rank])'

CASES = register(
    [
        # helper 142: named (it read "you picked cuda:None")
        Case(GPU, "device-without-an-index", "has no index - it means the current device",
             edits=(('torch.device("cuda", local_rank)', 'torch.device("cuda")'),)),
        # from an eighth learner review: ids that are not consecutive ("7,5", rank 1)
        Case(GPU, "first-listed-plus-local-rank", "the first listed id plus LOCAL_RANK",
             edits=(("int(listed.split(\",\")[local_rank])",
                     "int(listed.split(\",\")[0]) + local_rank"),)),
        # helper 161: the one-node environments lacked GROUP_RANK (torchrun sets it): a
        # KeyError, not the lesson's point
        Case(GPU, "local-rank-from-group-rank", "that holds only when every node runs as many",
             edits=((LOCAL, 'local_rank = int(env["RANK"]) - int(env["GROUP_RANK"]) * '
                            'int(env["LOCAL_WORLD_SIZE"])'),)),
        Case(GPU, "global-rank-as-device", "the global RANK",
             edits=((LOCAL, 'local_rank = int(env["RANK"])'),)),
        Case(GPU, "physical-id-as-device", "the physical id",
             edits=((DEVICE, "device = None"),
                    (PHYSICAL, PHYSICAL + '\n    device = torch.device("cuda", physical)'))),
        Case(GPU, "ignores-cuda-visible-devices", "the LOCAL_RANK",
             edits=((PHYSICAL, "physical = local_rank"),)),
        # helper 152: seed 000's dist.get_rank() was told "not os.environ"
        Case(GPU, "dist-get-rank-as-device", "dist.get_rank() (seed 000's line)",
             edits=((LOCAL, 'local_rank = __import__("torch").distributed.get_rank()'),)),
        Case(GPU, "reads-os-environ-not-env", "not os.environ",
             edits=((LOCAL, 'local_rank = int(__import__("os").environ["LOCAL_RANK"])'),)),
        Case(GPU, "rank-mod-local-world-size", "only when every node runs as many ranks",
             edits=((LOCAL, 'local_rank = int(env["RANK"]) % int(env["LOCAL_WORLD_SIZE"])'),)),
        Case(GPU, "physical-id-as-str", "(str), not an int",
             edits=(("int(listed.split(\",\")[local_rank])",
                     "listed.split(\",\")[local_rank].strip()"),)),
        Case(GPU, "sorted-list", "expected 7",
             edits=(('listed.split(",")', 'sorted(listed.split(","), key=int)'),)),
        # helper 109: the stub's rule, "no torch.cuda call" - named, even when harmless here
        Case(GPU, "device-count-modulo", "called torch.cuda.device_count()",
             edits=((DEVICE, 'device = torch.device("cuda", local_rank % '
                             "max(torch.cuda.device_count(), 1))"),)),
        Case(GPU, "device-count-asked-aside", "called torch.cuda.device_count()",
             edits=((DEVICE, DEVICE + "\n    torch.cuda.device_count()"),)),
        Case(GPU, "cpu-when-unavailable", "called torch.cuda.is_available()",
             edits=((DEVICE, DEVICE + ' if torch.cuda.is_available() else torch.device("cpu")'),)),
        # from a learner review
        Case(GPU, "digits-read-one-by-one", "expected 13",  # right while every id was one digit
             edits=(('int(listed.split(",")[local_rank])',
                     "[int(c) for c in listed if c.isdigit()][local_rank]"),)),
        # from a twenty-fifth-session learner review: the IndexError was blamed on the rank
        Case(GPU, "split-on-comma-and-space", "one entry per comma",
             edits=(('int(listed.split(",")[local_rank])',
                     'int(listed.split(", ")[local_rank])'),)),
        Case(GPU, "list-indexed-by-rank", "the list is per node",
             edits=(('int(listed.split(",")[local_rank])',
                     'int(listed.split(",")[int(env["RANK"])])'),)),
        # from a second learner review
        Case(GPU, "physical-id-from-rank-without-a-list", "without CUDA_VISIBLE_DEVICES",
             edits=((PHYSICAL, 'physical = int(env["RANK"]) if listed is None else '
                               'int(listed.split(",")[local_rank])'),)),
        Case(GPU, "rank-minus-node-offset", "RANK - GROUP_RANK x LOCAL_WORLD_SIZE",
             edits=((LOCAL, 'local_rank = int(env["RANK"]) - int(env.get("GROUP_RANK", 0)) '
                            '* int(env["LOCAL_WORLD_SIZE"])'),)),
        # helper 118: CUDA_VISIBLE_DEVICES from os.environ (the launch's "") raised an
        # IndexError in a scenario without the variable, and nothing said why
        Case(GPU, "cuda-visible-devices-from-os-environ",
             "read CUDA_VISIBLE_DEVICES from os.environ",
             edits=(('listed = env.get("CUDA_VISIBLE_DEVICES")',
                     'listed = __import__("os").environ.get("CUDA_VISIBLE_DEVICES")'),)),
        # noticed by the sixteenth session: a hard-coded cuda:0 was told "not os.environ"
        Case(GPU, "hard-coded-cuda-0", "cuda:0 for every rank in every environment",
             edits=((DEVICE, 'device = torch.device("cuda", 0)'),)),
        # helper 129: a string indexed, not split: the ValueError of int(",") explained
        Case(GPU, "string-indexed-not-split", "is a string: indexing it gives one character",
             edits=(("int(listed.split(\",\")[local_rank])", "int(listed[local_rank])"),)),
    ]
)  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)


def test_the_check_also_asks_with_this_launchs_own_environment(monkeypatch):
    """Helper 95: "and with the rank's own environment from torchrun" never happened, since a
    check always hides the GPUs (CUDA_VISIBLE_DEVICES=""): the rank's own variables are now
    asked without that hiding, as on a node that sets none."""
    import importlib.util
    from types import SimpleNamespace

    from conftest import SCRIPTS
    from ddp_tutorial.exercises import lesson03

    spec = importlib.util.spec_from_file_location(
        "sol", SCRIPTS / "exercises/solutions/03_rank_gpu.py"
    )
    solution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(solution)
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**env, "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(name, value)
    answers = lesson03.run_gpu(solution, SimpleNamespace(rank=1))["answers"]
    own = [a for a in answers if a["where"].startswith("this launch")]
    assert len(own) == 1 and "raised" not in own[0] and own[0]["env"] == env, own
    assert lesson03.judge_gpu([{"answers": answers}] * 2) is None
