"""What a GPU machine will do, proven here without one: scripts, Makefile, gpu-check.

Each test pins a GPU-side behaviour that this CPU-only machine can still check:
the scripts' device discipline (read from their source), the Makefile's
commands (``make -n``), and that ``make gpu-check`` collects and starts on a
machine with only torch, pytest, psutil, nvidia-ml-py, matplotlib and tqdm.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO, SCRIPTS


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_every_script_keeps_what_it_communicates_on_the_ranks_device(path):
    """With nccl every tensor a collective sees, and every DDP module, must be on the GPU.

    "auto" picks nccl on a GPU machine; a script that keeps its model or its
    tensors on the CPU then stops with "No backend type associated with device
    type cpu". So a script that joins a group either uses ``info.device`` or
    pins gloo and says why.
    """
    text = path.read_text()
    if not re.search(r"process_group\(|setup\(", text):
        return
    pinned = 'backend="gloo"' in text or 'default="gloo"' in text
    assert "info.device" in text or pinned, f"{path.name}: neither info.device nor pinned gloo"
