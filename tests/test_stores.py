"""ddp_tutorial.stores.job_store: every rank of a (re)start agrees on one attempt number.

The multi-node restart itself runs in lesson 10 (two torchrun "nodes", asserted there);
whether its two agents then count restarts differently depends on which of them saw
the failure first. Here the disagreement is made on purpose: two real processes join
one shared store (as torchrun's agent store is shared) with different
TORCHELASTIC_RESTART_COUNTs, as a failed node and the node restarted only because of
it would have. A prefix made of that count would put them under different keys
(pytorch#135712); job_store must give both the same attempt, and a new one per restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

JOIN = """
import json, sys
from ddp_tutorial.stores import job_store
store, attempt = job_store(int(sys.argv[1]), 2, timeout_s=30)
store.set(f"rank{sys.argv[1]}", "here")  # under this attempt's prefix
print(json.dumps({"attempt": attempt}))
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("counted", [0, 1], ids=["rank 0's agent counted", "rank 0's is stale"])
def test_ranks_whose_agents_counted_differently_agree_on_the_attempt(counted):
    """``counted``: the rank whose agent counted the restart; the other's count is stale.
    With rank 0's count stale, an attempt taken from rank 0's own count would repeat 0."""
    from ddp_tutorial.stores import ROOT

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    seen = []
    for restart in range(2):  # the first start, then one restart of the job
        counts = {counted: restart, 1 - counted: 0}  # one node's agent counted the failure
        ranks = [
            subprocess.Popen([sys.executable, "-c", JOIN, str(rank)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**base, "TORCHELASTIC_RESTART_COUNT": str(counts[rank])})
            for rank in (1, 0)
        ]  # fmt: skip
        outs = [p.communicate(timeout=60) for p in ranks]
        assert all(p.returncode == 0 for p in ranks), outs
        attempts = {json.loads(out)["attempt"] for out, _ in outs}
        assert len(attempts) == 1, f"the ranks disagree: {attempts} (restart counts {counts})"
        seen.append(attempts.pop())
    assert seen == [0, 1], "a new attempt number at every (re)start, whatever the agents count"
    for attempt in seen:  # each attempt's keys sit under its own prefix, both ranks' there
        assert all(agent.check([f"{ROOT}/{attempt}/rank{r}"]) for r in (0, 1)), attempt
