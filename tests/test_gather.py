"""``all_gather_uneven`` (ddp_tutorial.gather) where lesson 01 does not take it.

Lesson 01 gathers 2 and 3 rows from 2 ranks and asserts the result equals
``all_gather_object``; here 3 real gloo ranks, one of them with no rows at
all, 2-D rows, and an integer dtype. And lesson 02's gather of predictions
with their sample indices (``gather_predictions`` of
``scripts/demos/sampling.py``, the code the lesson shows) on a length that pads.
"""

from __future__ import annotations

import pytest

from conftest import REPO
from ddp_tutorial.harness.launch import torchrun

GATHER = """
import sys

import torch
from ddp_tutorial.distributed import process_group
from ddp_tutorial.gather import all_gather_uneven
from ddp_tutorial.records import write_rank_record

with process_group(backend="gloo") as info:
    rows = [0, 3, 1][info.rank]  # rank 0 has nothing to send
    local = torch.arange(rows * 2, dtype=torch.int64).reshape(rows, 2) + 100 * info.rank
    gathered = all_gather_uneven(local)
    scalar = all_gather_uneven(torch.tensor(float(info.rank)))
    write_rank_record(sys.argv[-1], {
        "shapes": [list(t.shape) for t in gathered],
        "values": [t.tolist() for t in gathered],
        "dtypes": sorted({str(t.dtype) for t in gathered}),
        "scalar": [t.tolist() for t in scalar],
    })
"""


@pytest.mark.torchrun
def test_uneven_gather_on_three_ranks(tmp_path, write_script):
    script = write_script("gather_uneven.py", GATHER)
    result = torchrun(script, nproc=3, run_dir=tmp_path / "run", timeout=120, echo=False)
    expected = [[], [[100, 101], [102, 103], [104, 105]], [[200, 201]]]
    for record in result.records:
        assert record["shapes"] == [[0, 2], [3, 2], [1, 2]]
        assert record["values"] == expected
        assert record["dtypes"] == ["torch.int64"]
        assert record["scalar"] == [[0.0], [1.0], [2.0]]  # a 0-d tensor counts as one row


PREDICT = """
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset
from ddp_tutorial.distributed import process_group
import importlib.util
from ddp_tutorial.records import write_rank_record

spec = importlib.util.spec_from_file_location("sampling_demo", DEMO)
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)  # the script lesson 02 runs and shows, imported
gather_predictions = demo.gather_predictions

with process_group(backend="gloo") as info:
    n = 10  # 3 ranks: 4 samples each, 2 of the 12 are padding
    classes = torch.arange(n) * 7 % 3
    data = TensorDataset(nn.functional.one_hot(classes, 3).float(), classes)
    pred = gather_predictions(nn.Identity(), data, info.device, batch_size=3)
    write_rank_record(sys.argv[-1], {"pred": pred.tolist()})
"""


@pytest.mark.torchrun
def test_gathered_predictions_are_every_sample_once_in_order(tmp_path, write_script):
    demo = REPO / "scripts" / "demos" / "sampling.py"
    script = write_script("gather_predictions.py", PREDICT.replace("DEMO", repr(str(demo))))
    result = torchrun(script, nproc=3, run_dir=tmp_path / "run", timeout=120, echo=False)
    expected = [i * 7 % 3 for i in range(10)]  # identity model: the prediction is the class
    assert [r["pred"] for r in result.records] == [expected] * 3
