"""Which network interface gloo and NCCL would use, and whether other nodes can reach it.

On one machine any interface works, loopback included. Across machines the
ranks must connect to each other's addresses, and the two backends pick
theirs differently:

* **gloo** uses ``GLOO_SOCKET_IFNAME`` when set; otherwise it resolves this
  machine's hostname and uses that address. Many images map the hostname to
  ``127.0.1.1`` or ``127.0.0.1`` in ``/etc/hosts``: then every rank
  advertises a loopback address, and the other nodes connect to themselves.
* **NCCL** uses ``NCCL_SOCKET_IFNAME`` when set; otherwise it prefers
  InfiniBand (``ib*``), then any interface except ``docker*`` and ``lo``,
  and falls back to those. Set to ``lo`` or to a Docker bridge (``docker0``
  is a host-private network, the same 172.17.0.1 on every machine), or
  picked by default on a machine with nothing else, it cannot reach the
  other nodes.

Both failures look like a hang at the first collective, or a rendezvous
timeout, so ``ddp-tutorial doctor`` warns before the job starts, when the
environment says the job spans several nodes (:func:`job_nodes`).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping

from ddp_tutorial.harness.checks import Finding, matching_interfaces

UNREACHABLE_PREFIXES = ("lo", "docker")
"""Interfaces other nodes cannot reach: loopback, and Docker's host-private bridges."""


def job_nodes(env: Mapping[str, str]) -> int:
    """How many nodes the job spans, as the environment tells it (1 when it does not).

    SLURM's node count, torchrun's ``PET_NNODES`` (``--nnodes`` given through
    the environment; ``1:4`` counts as 4), or, inside a rank, ``WORLD_SIZE``
    over ``LOCAL_WORLD_SIZE``.
    """
    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES"):
        value = env.get(var, "").split(":")[-1].strip()
        if value.isdigit():
            return max(1, int(value))
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, math.ceil(int(world) / int(local)))
    return 1


def unreachable(name: str | None) -> bool:
    """Whether other nodes cannot reach an interface of this name (see the module docstring)."""
    return name is not None and name.startswith(UNREACHABLE_PREFIXES)


def gloo_interface(
    env: Mapping[str, str], addresses: Mapping[str, list[str]], host_address: str | None
) -> tuple[str | None, str]:
    """``(interface, how it was chosen)`` for gloo; ``addresses``: interface -> its IPs."""
    named = env.get("GLOO_SOCKET_IFNAME")
    if named:
        return named.split(",")[0], "GLOO_SOCKET_IFNAME"
    if host_address is None:
        return None, "the hostname does not resolve"
    how = f"the hostname resolves to {host_address}"
    if host_address.startswith("127."):
        return "lo", how  # the whole 127.0.0.0/8 is the loopback interface's
    owner = next((name for name, ips in addresses.items() if host_address in ips), None)
    return owner, how


def nccl_interface(env: Mapping[str, str], names: list[str]) -> tuple[str | None, str]:
    """``(interface, how it was chosen)`` for NCCL's socket transport (its bootstrap)."""
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec:
        chosen = matching_interfaces(spec, names)
        return (chosen[0] if chosen else None), "NCCL_SOCKET_IFNAME"
    ordered = (
        [n for n in names if n.startswith("ib")]
        + [n for n in names if not n.startswith(("ib", *UNREACHABLE_PREFIXES))]
        + [n for n in names if n.startswith("docker")]
        + [n for n in names if n.startswith("lo")]
    )
    return (ordered[0] if ordered else None), "NCCL's default order (ib*, others, docker*, lo)"


def host_address() -> str | None:
    """The address this machine's hostname resolves to (what gloo advertises), or None."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def check_node_interfaces(
    env: Mapping[str, str],
    gpus: int,
    addresses: Mapping[str, list[str]] | None = None,
    hostname_address: str | None = "",
) -> Finding:
    """Warn when a multi-node job would talk over ``lo`` or a ``docker*`` bridge.

    ``addresses`` (interface -> IPs) and ``hostname_address`` default to this
    machine's; a test passes others. NCCL is considered only where there are GPUs.
    """
    if addresses is None:
        import psutil

        addresses = {n: [a.address for a in a_list] for n, a_list in psutil.net_if_addrs().items()}
    if hostname_address == "":
        hostname_address = host_address()
    picks = {"gloo": gloo_interface(env, addresses, hostname_address)}
    if gpus > 0:
        picks["nccl"] = nccl_interface(env, sorted(addresses))
    nodes = job_nodes(env)
    detail = f"{nodes} node(s); " + "; ".join(
        f"{backend} would use {name or 'no interface'} ({how})"
        for backend, (name, how) in picks.items()
    )
    bad = [backend for backend, (name, _) in picks.items() if unreachable(name)]
    if nodes > 1 and bad:
        variables = " / ".join(f"{b.upper()}_SOCKET_IFNAME" for b in bad)
        return Finding(
            "interfaces",
            "warn",
            detail + f": other nodes cannot reach {', '.join(picks[b][0] for b in bad)}",
            f"set {variables} to the interface that reaches the other nodes "
            "(`ip route get <MASTER_ADDR>` names it), or fix the hostname in /etc/hosts",
        )
    return Finding("interfaces", "ok", detail)
