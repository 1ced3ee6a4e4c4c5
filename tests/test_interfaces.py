"""``ddp-tutorial doctor``'s multi-node interface check, on machines described by hand.

Pure functions of the environment and an interface table: no network is
touched, so a laptop can check what a cluster node with Docker would get.
"""

from __future__ import annotations

import pytest

from ddp_tutorial.harness.interfaces import (
    check_node_interfaces,
    gloo_interface,
    job_nodes,
    nccl_interface,
)

NODE = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "docker0": ["172.17.0.1"]}
DOCKER_ONLY = {"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"]}
IB = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.1.5"]}


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({}, 1),
        ({"SLURM_JOB_NUM_NODES": "4"}, 4),
        ({"SLURM_NNODES": "2"}, 2),
        ({"PET_NNODES": "1:3"}, 3),  # torchrun --nnodes 1:3 through the environment
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # inside a rank
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 1),
        ({"SLURM_JOB_NUM_NODES": "garbage"}, 1),
    ],
)
def test_job_nodes(env, nodes):
    assert job_nodes(env) == nodes


def test_gloo_follows_the_hostname_or_its_variable():
    assert gloo_interface({}, NODE, "127.0.1.1") == ("lo", "the hostname resolves to 127.0.1.1")
    assert gloo_interface({}, NODE, "10.0.0.5")[0] == "eth0"
    assert gloo_interface({}, NODE, "172.17.0.1")[0] == "docker0"
    assert gloo_interface({"GLOO_SOCKET_IFNAME": "eth0"}, NODE, "127.0.0.1")[0] == "eth0"
    assert gloo_interface({}, NODE, None)[0] is None


def test_nccl_default_order_and_variable():
    assert nccl_interface({}, sorted(IB))[0] == "ib0"
    assert nccl_interface({}, sorted(NODE))[0] == "eth0"  # never docker0 or lo by default
    assert nccl_interface({}, sorted(DOCKER_ONLY))[0] == "docker0"  # nothing better here
    assert nccl_interface({"NCCL_SOCKET_IFNAME": "lo"}, sorted(NODE))[0] == "lo"
    assert nccl_interface({"NCCL_SOCKET_IFNAME": "^docker,lo"}, sorted(NODE))[0] == "eth0"


def test_warns_only_on_a_multi_node_job():
    one = check_node_interfaces({}, gpus=0, addresses=NODE, hostname_address="127.0.1.1")
    assert one.status == "ok" and "gloo would use lo" in one.detail  # fine on one node
    two = {"SLURM_JOB_NUM_NODES": "2"}
    warned = check_node_interfaces(two, gpus=0, addresses=NODE, hostname_address="127.0.1.1")
    assert warned.status == "warn" and "GLOO_SOCKET_IFNAME" in warned.fix
    fixed = {**two, "GLOO_SOCKET_IFNAME": "eth0"}
    assert check_node_interfaces(fixed, 0, NODE, "127.0.1.1").status == "ok"


def test_nccl_on_a_docker_bridge_is_named():
    env = {"SLURM_JOB_NUM_NODES": "2", "NCCL_SOCKET_IFNAME": "docker0"}
    finding = check_node_interfaces(env, gpus=8, addresses=NODE, hostname_address="10.0.0.5")
    assert finding.status == "warn" and "docker0" in finding.detail
    assert "NCCL_SOCKET_IFNAME" in finding.fix and "GLOO" not in finding.fix
    no_gpu = check_node_interfaces(env, gpus=0, addresses=NODE, hostname_address="10.0.0.5")
    assert no_gpu.status == "ok"  # no GPU, no nccl: only gloo's choice matters
