"""scripts/compare: the speed comparison's summary, and what step_costs.py times."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def speed():
    return load_script("compare/speed.py")


@pytest.fixture(scope="module")
def step_costs():
    return load_script("compare/step_costs.py")


def test_the_summary_pairs_rounds_and_compares_best_launches(speed):
    rates = {"template": [100.0, 90.0, 120.0], "bare": [110.0, 80.0, 100.0], "fabric": [50.0] * 3}
    s = speed.summarize(rates)
    assert s["ratios"]["bare"] == pytest.approx([100 / 110, 90 / 80, 120 / 100])
    assert s["median_ratio"]["bare"] == pytest.approx(90 / 80)
    assert s["range"]["bare"] == pytest.approx([100 / 110, 120 / 100])
    assert s["best_ratio"] == pytest.approx({"bare": 120 / 110, "fabric": 120 / 50})
    assert "template" not in s["ratios"]


def test_step_costs_times_the_calls_train_py_makes(step_costs):
    """Each piece the tool times as the template's is a call the template's loop makes, and
    the bare optimizer is loops.py's: renaming one in the scripts fails here."""
    train = (SCRIPTS / "train.py").read_text()
    loop = train[train.index("# 8. The loop.") : train.index("# 9. Metrics")]
    for call in ("nn.utils.clip_grad_norm_(", "with autocast():", "scaler.unscale_(optimizer)",
                 "set_lr(optimizer, lr, peak_lr)", "lr_at(", "kit.counted_targets(y, loss_fn)",
                 "dist.all_reduce(total, async_op=True)", "counting.wait()",
                 "loss_sum += torch.stack(",
                 "checks.observe(step, loss)", "checks.check(step)", "log.step(step,"):  # fmt: skip
        assert call in loop, call
    assert "autocast = partial(torch.autocast," in train
    assert "kit.build_optimizer(args.optimizer, ddp, peak_lr, args.weight_decay)" in train
    loops = (SCRIPTS / "compare" / "loops.py").read_text()
    assert "torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)" in loops
    assert "StopCheck(device, save_minutes" in train  # every 10 steps: the tool's 0.9 / 0.1


def test_step_costs_adds_up_the_template_side_against_the_bare_side(
    step_costs, world_of_one, own_signal_handlers
):
    args = argparse.Namespace(model="mlp", image_size=8, batch_size=4, number=3, repeats=1)
    result = step_costs.measure(args)
    rows = {r["piece"]: r for r in result["rows"]}
    assert all(r["us_per_call"] > 0 for r in rows.values())

    def side(s: str) -> float:
        return sum(r["us_per_step"] for r in rows.values() if r["side"] in (s, "both"))

    assert result["bare_step_us"] == pytest.approx(side("bare"))
    assert result["template_step_us"] == pytest.approx(side("template"))
    assert result["extra_us"] == pytest.approx(side("template") - side("bare"))
    checks = [r for r in rows.values() if r["piece"].startswith("StopCheck.check")]
    assert sum(r["calls_per_step"] for r in checks) == pytest.approx(1)  # one check a step


def test_every_script_that_wraps_in_ddp_imports_torch_distributed_nn_before_init():
    """DDP imports torch.distributed.nn; after init_process_group its default arguments
    keep the group alive and a rank can die at exit with SIGABRT (distributed.py)."""
    missing = []
    demo = SCRIPTS / "demos" / "teardown.py"  # shows the leak: imports it only when asked
    assert "importlib.import_module(PINNING_MODULE)" in demo.read_text()
    for path in sorted(set(SCRIPTS.rglob("*.py")) - {demo}):
        text = path.read_text()
        if "init_process_group(" in text and re.search(r"\bDDP\(|DistributedDataParallel\(", text):
            if not re.search(r"^import torch\.distributed\.nn\b", text, re.MULTILINE):
                missing.append(str(path.relative_to(SCRIPTS)))
    assert not missing, missing


@pytest.mark.torchrun
def test_one_round_launches_the_template_and_the_bare_loop_and_compares_them(speed, tmp_path):
    """speed.py end to end on a tiny workload: both scripts take its flags (96 samples, batch
    4: 24 steps on one rank) and the rate launch() returns is the samples each counted over
    the seconds it timed."""
    work = {"model": "cnn", "image_size": 8, "batch_size": 4, "num_samples": 96}  # 24 steps
    rates = {k: speed.launch(k, work, 1, tmp_path / k, monitor=False)
             for k in ("template", "bare")}  # fmt: skip
    bare = json.loads((tmp_path / "bare" / "metrics.json").read_text())
    assert bare["counted_steps"] == 24 - bare["warmup_steps"] and bare["world_size"] == 1
    assert bare["steps"] == 24 and bare["batch_size"] == 4
    assert rates["bare"] == pytest.approx(bare["counted_steps"] * 4 / max(bare["rank_seconds"]))
    template = json.loads((tmp_path / "template" / "metrics.json").read_text())
    assert (template["steps"], template["global_batch"], template["world_size"]) == (24, 4, 1)
    assert rates["template"] == template["samples_per_sec"] > 0
