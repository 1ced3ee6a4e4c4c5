"""What a whole log adds to one of ``ddp-tutorial explain``'s messages (harness/messages.py).

A line alone can mislead or say too little: these read the rest of the log - whether a
"Missing key(s)" list differs from the "Unexpected" one by a 'module.' prefix only, which
other processes hold a full GPU, whether a rank was SIGKILLed or a reset came during init.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ddp_tutorial.harness.rank_lines import RAISED

# Each list up to the other one: a log that joins lines puts both on one
_KEY_LIST = re.compile(
    r"(?m)(?P<side>Missing|Unexpected) key\(s\) in state_dict:"
    r"(?P<names>[^\n]*?)(?=(?:Missing|Unexpected) key|$)"
)


_WRAPPER_PREFIX = re.compile(r"^(?:module\.|_orig_mod\.)+")  # DDP's, torch.compile's


def prefix_explains(text: str) -> bool:
    """A name in both lists once the wrappers' prefixes ('module.', torch.compile's
    '_orig_mod.') are stripped: only the prefix differs. A Missing list alone ('module.' names
    of new layers under DDP) or other names is not that."""
    sides: dict[str, set[str]] = {"Missing": set(), "Unexpected": set()}
    for m in _KEY_LIST.finditer(text):
        names = re.findall(r'"([^"]+)"', m["names"])  # quoted: a list may be cut short
        sides[m["side"]] |= {_WRAPPER_PREFIX.sub("", n) for n in names}
    return bool(sides["Missing"] & sides["Unexpected"])


def other_processes(line: str, text: str) -> str:
    """What the other processes CUDA lists hold on this GPU, beside this one: fix the larger."""
    found = re.findall(r"Process (\d+) has ([\d.]+) ([MG])iB memory in use", line)
    others = {pid: (size, unit) for pid, size, unit in found}  # each process once
    if not others:
        return "no other process listed (older torch lists none: nvidia-smi shows who holds it)"
    gib = sum(float(size) / (1 if unit == "G" else 1024) for size, unit in others.values())
    own = re.search(r"this process has ([\d.]+ [MG]iB) memory in use", line)
    mine = re.search(r"allocated memory ([\d.]+) GiB is allocated by PyTorch", line)
    if not own and mine and len(others) == 1 and gib >= float(mine[1]):  # a container's pids
        return (
            f"the one process listed holds {gib:.2f} GiB, at least the {mine[1]} GiB PyTorch "
            "allocated in this process: likely this rank itself (a container lists it by pid): "
            "its batch or model is too large for the GPU, not other ranks' contexts"
        )
    return (
        f"{len(others)} other process{'es' * (len(others) > 1)} hold {gib:.2f} GiB of this GPU "
        f"(other ranks' CUDA contexts){f', this one {own[1]}' if own else ''}"
    )


def said_if(pattern: str, said: str) -> Callable[[str, str], str | None]:
    """A ``detail`` that says ``said`` when the whole log matches ``pattern``."""
    return lambda line, text: said if re.search(pattern, text) else None


killed_rank = said_if(
    r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)",
    "a rank was killed by signal 9: it wrote no traceback, so no error_file or line of its "
    "own says why (see killed-sigkill)",
)
reset_at_init = said_if(
    r"line \d+, in (?:init_process_group|\w*rendezvous\w*)\b",
    "the reset came inside init_process_group, before any collective: more likely the "
    "network (a firewall, a wrong address) or the store's host than a crashed rank",
)


dtensor_file = said_if(
    r"must be imported to load DTensors",
    "the file holds DTensors (an FSDP2 model's own state_dict, this rank's shards only): "
    "import torch.distributed.tensor before the load and weights_only stays True; for a "
    "plain model, save get_model_state_dict(model, options=StateDictOptions("
    "full_state_dict=True)) (lesson 12)",
)


def cuda_failure(line: str, text: str) -> str | None:
    """NCCL's own "Cuda failure" line, which says more than the exception that follows it."""
    m = re.search(r"Cuda failure[^\n]*", text)
    return f"NCCL's own line: {m[0].strip()}" if m else None


def saved_before_exit(line: str, text: str) -> str | None:
    """The template's (or lesson 08's) own line: which step the ranks saved before exiting."""
    m = re.search(r"(SIG[A-Z0-9]+): saved step (\d+), exit 75", text)
    if m is None:
        return None
    return f"on {m[1]} the ranks saved step {m[2]}, then exited 75: the rerun resumes there"


def after_spawn_marker(line: str, text: str) -> str | None:
    """The error line that follows mp.spawn's "-- Process N terminated" (the fallback would
    point at ``ProcessRaisedException:``, whose message is empty)."""
    after = text.split(line, 1)[-1].splitlines()
    errors = [ln.strip() for ln in after if RAISED.match(ln)]  # a raised exception's line
    return f"the process's error: {errors[0][:200]}" if errors else None
