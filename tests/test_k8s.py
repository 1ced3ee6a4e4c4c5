"""Kubernetes (lesson 10): the Kubeflow manifests against the operators' emulation.

``scripts/k8s/*.yaml`` are what a user applies; lesson 10 runs the pods they would
make, with the variables ``ddp_tutorial.lessons.cluster`` says the operators set.
These tests hold the two together (same command, same process count, same
variable names), so neither the files nor the lesson can drift, and check that
torchrun itself reads every ``PET_*`` variable the operators set.
"""

from __future__ import annotations

import sys

import pytest

from conftest import DEMOS, SCRIPTS
from ddp_tutorial.lessons import cluster
from ddp_tutorial.loop import parse_template_args

yaml = pytest.importorskip("yaml")  # a test dependency; gpu-check machines may lack it

K8S = SCRIPTS / "k8s"


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def gpus(resources: dict) -> int:
    return int(resources["limits"]["nvidia.com/gpu"])


def test_pytorchjob_matches_the_emulation():
    job = manifest("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"] == cluster.JOB_NAME
    assert job["spec"]["nprocPerNode"] == str(cluster.NPROC_PER_POD)  # a string in the API
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert sorted(replicas) == ["Master", "Worker"] and replicas["Master"]["replicas"] == 1
    assert sum(r["replicas"] for r in replicas.values()) == cluster.PODS
    containers = [r["template"]["spec"]["containers"] for r in replicas.values()]
    assert containers[0] == containers[1], "every pod runs the same container"
    (pod,) = containers[0]
    assert pod["name"] == "pytorch"  # the operator looks for this name...
    assert pod["command"] == list(cluster.POD_COMMAND)  # a bare torchrun
    assert {"name": "pytorchjob-port", "containerPort": cluster.PYTORCHJOB_PORT} in pod["ports"]
    assert gpus(pod["resources"]) == cluster.NPROC_PER_POD, "one process per GPU of the pod"
    args = parse_template_args(pod["args"])  # flags the template really has
    mounts = [m["mountPath"] for m in pod["volumeMounts"]]
    assert any(args.checkpoint_dir.startswith(m + "/") for m in mounts), "on the shared volume"
    # helper 96: Kubernetes' default grace is 30 s, torchrun's wait 30 s too: the save needs
    # more than a small model's; and failed.json must end the job, not crash-loop it
    spec = replicas["Master"]["template"]["spec"]
    shutdown = cluster.torchrun_reads({e["name"]: e["value"] for e in pod["env"]})
    assert shutdown == {"--shutdown-timeout": 100}  # torchrun reads it as its flag
    assert spec["terminationGracePeriodSeconds"] > shutdown["--shutdown-timeout"] + 5
    assert job["spec"]["runPolicy"]["backoffLimit"] > 0


def test_trainjob_matches_the_emulation():
    job = manifest("trainjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["name"] == cluster.JOB_NAME
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == list(cluster.POD_COMMAND)
    assert trainer["numNodes"] == cluster.PODS
    assert trainer["numProcPerNode"] == cluster.NPROC_PER_POD
    assert gpus(trainer["resourcesPerNode"]) == cluster.NPROC_PER_POD
    parse_template_args(trainer["args"])
    # the same save time as the PyTorchJob's; the grace period is the runtime's (the TrainJob's
    # pod overrides have no such field), so the comments must say where to set it
    shutdown = cluster.torchrun_reads({e["name"]: e["value"] for e in trainer["env"]})
    assert shutdown == {"--shutdown-timeout": 100}
    text = (K8S / "trainjob.yaml").read_text()
    assert "terminationGracePeriodSeconds" in text and "ClusterTrainingRuntime" in text
    # the two manifests run the same training
    pod = manifest("pytorchjob.yaml")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert trainer["args"] == pod["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [("pytorchjob.yaml", cluster.PYTORCHJOB_ENV + cluster.PYTORCHJOB_ELASTIC_ENV),
     ("trainjob.yaml", cluster.TRAINJOB_ENV)],
)  # fmt: skip
def test_each_manifest_names_the_variables_its_operator_sets(name, expected):
    """The comments teach the variables: every one the emulation sets is named there."""
    text = (K8S / name).read_text()
    assert [v for v in expected if v not in text] == []


def test_the_operators_variables():
    for pod in range(cluster.PODS):
        env = cluster.pytorchjob_env(pod)
        assert tuple(env) == cluster.PYTORCHJOB_ENV
        assert env["RANK"] == env["PET_NODE_RANK"] == str(pod), "RANK is the pod's index"
        assert env["WORLD_SIZE"] == str(cluster.PODS * cluster.NPROC_PER_POD), "processes"
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "ddp-train-master-0"
        env = cluster.trainjob_env(pod)
        assert tuple(env) == cluster.TRAINJOB_ENV and "RANK" not in env
        assert env["PET_MASTER_ADDR"] == "ddp-train-node-0-0.ddp-train"
    assert tuple(cluster.pytorchjob_elastic_env(1, 2, 3)) == cluster.PYTORCHJOB_ELASTIC_ENV


def test_torchrun_reads_every_pet_variable_as_its_flag():
    """torch/distributed/argparse_util.py: each option defaults to $PET_<DEST>."""
    reads = cluster.torchrun_reads(cluster.pytorchjob_env(1))
    assert reads == {"--master-addr": "ddp-train-master-0", "--master-port": 23456,
                     "--nproc-per-node": "2", "--node-rank": 1, "--nnodes": "2"}  # fmt: skip
    reads = cluster.torchrun_reads(cluster.trainjob_env(1))
    assert reads["--node-rank"] == 1 and reads["--master-port"] == cluster.TRAINJOB_PORT
    reads = cluster.torchrun_reads(cluster.pytorchjob_elastic_env(1, 2, 3))
    assert reads == {"--rdzv-endpoint": "ddp-train-worker-0:23456", "--rdzv-backend": "c10d",
                     "--nnodes": "1:2", "--max-restarts": 3}  # fmt: skip


def test_a_pet_name_torchrun_does_not_know_is_refused():
    # an early design document of the operator spelled it PET_N_PROC_PER_NODE: torchrun ignores it
    with pytest.raises(KeyError, match="no option --n-proc-per-node"):
        cluster.torchrun_reads({"PET_N_PROC_PER_NODE": "2"})


def test_a_pod_starts_with_only_its_operators_identity(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("PET_NNODES", "9")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "old")
    env = cluster.pod_environment(cluster.trainjob_env(0))
    assert "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env
    assert env["PET_NNODES"] == str(cluster.PODS) and env["PATH"]


@pytest.mark.torchrun
def test_a_bare_torchrun_in_each_pod_forms_the_job(tmp_path):
    """Two PyTorchJob pods on loopback: torchrun overwrites the pod's RANK and WORLD_SIZE."""
    from ddp_tutorial.distributed import free_port

    port, nproc = free_port(), cluster.NPROC_PER_POD
    command = [sys.executable, "-m", "torch.distributed.run", str(DEMOS / "pod_env.py"),
               "--out", str(tmp_path)]  # fmt: skip
    pods = {i: (command, cluster.pytorchjob_env(i, host="127.0.0.1", port=port))
            for i in range(cluster.PODS)}  # fmt: skip
    for i, run in cluster.run_pods(pods, timeout=120).items():
        assert run.returncode == 0, f"pod {i}: {run.output[-2000:]}"
    seen = cluster.read_pod_records(tmp_path)
    assert sorted(int(r["RANK"]) for r in seen) == list(range(cluster.PODS * nproc))
    for r in seen:
        assert int(r["RANK"]) == int(r["PET_NODE_RANK"]) * nproc + int(r["LOCAL_RANK"])
        assert r["GROUP_RANK"] == r["PET_NODE_RANK"] and r["WORLD_SIZE"] == str(2 * nproc)
