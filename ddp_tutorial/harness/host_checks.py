"""Three doctor checks about the node itself: its memory for ranks x DataLoader workers,
whether its name is one the other nodes can reach, and whether the rendezvous port is free.

Host memory (lesson 12): a dataset held in each rank's memory as Python objects is copied,
page by page, into every DataLoader worker that reads it (reading a Python object writes its
reference count: copy-on-access), so a node holds up to ranks x (1 + workers) copies of it;
held in arrays it stays shared, one copy per rank. The doctor projects both against the
machine's memory.

Host name (lesson 10): torchrun gives every process of a multi-node job the rank-0 agent's
fully qualified host name as ``MASTER_ADDR`` (``socket.getfqdn()``, or ``--local-addr``); a
name the other nodes cannot resolve, or one that resolves to loopback, fails their
``init_process_group``.

Port (lessons 09, 10): the port the job's store would listen on here, judged as the store binds.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Mapping

import psutil

from ddp_tutorial import cgroups
from ddp_tutorial.harness.checks import Finding

GIB = 2**30
DEFAULT_MASTER_PORT = 29500  # torchrun's --master-port when none is given


def project_host_memory(ranks: int, workers: int, dataset_bytes: int, python_objects: bool) -> int:
    """Bytes the node holds of a dataset each rank keeps in memory (``dataset_bytes`` each):
    Python objects end up in every process that reads them, arrays stay one copy per rank."""
    copies = ranks * (1 + workers) if python_objects else ranks
    return copies * dataset_bytes


def check_host_memory(
    ranks: int,
    workers: int,
    dataset_gib: float | None = None,
    available: int | None = None,
) -> Finding:
    """The projection against the memory available now (``available``: psutil's, by default,
    or what this job's or container's cgroup still allows, when that is less)."""
    limited = ""
    if available is None:
        available = psutil.virtual_memory().available
        if (left := cgroups.memory_left()) is not None and left < available:
            available, limited = left, " (the cgroup's limit: this job's or container's)"
    processes = ranks * (1 + workers)
    detail = (
        f"{available / GIB:.1f} GiB available{limited}; {ranks} ranks x (1 + {workers} "
        f"DataLoader workers) = {processes} processes"
    )
    fix = (
        "keep the dataset (or its index: paths, labels, offsets) in numpy arrays or tensors, "
        "not lists or dicts of Python objects; or fewer --num-workers (lesson 12)"
    )
    if dataset_gib is None:
        fits = available / processes / GIB
        return Finding(
            "host memory",
            "ok",
            detail + f": a dataset of Python objects in each rank's memory fits up to "
            f"{fits:.2f} GiB (--dataset-gib X projects yours)",
        )
    size = int(dataset_gib * GIB)
    as_objects = project_host_memory(ranks, workers, size, python_objects=True)
    as_arrays = project_host_memory(ranks, workers, size, python_objects=False)
    detail += (
        f": a {dataset_gib:.2f} GiB dataset per rank takes up to {as_objects / GIB:.1f} GiB "
        f"as Python objects, {as_arrays / GIB:.1f} GiB as arrays"
    )
    if as_arrays > available:
        return Finding("host memory", "fail", detail + ": it does not fit either way", fix)
    if as_objects > available:
        return Finding("host memory", "warn", detail + ": as Python objects it does not fit", fix)
    return Finding("host memory", "ok", detail)


def check_host_name(local_addr: str | None = None) -> Finding:
    """What torchrun would give the other nodes as ``MASTER_ADDR`` from this node, and whether
    it resolves to an address they can reach (one node: loopback is fine)."""
    name = local_addr or socket.getfqdn()
    where = f"MASTER_ADDR from this node: {name!r}"
    fix = (
        "multi-node: torchrun --local-addr <this node's address on the network the nodes "
        "share>, or give the name a DNS or /etc/hosts entry on every node (lesson 10)"
    )
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return Finding("host name", "warn", f"{where} does not resolve here ({exc})", fix)
    addresses = sorted({str(entry[4][0]) for entry in found})
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return Finding(
            "host name",
            "warn",
            f"{where} resolves to {', '.join(addresses)}: loopback, which other nodes "
            "cannot reach (fine for one node)",
            fix,
        )
    return Finding("host name", "ok", f"{where} resolves to {', '.join(addresses)}")


def port_in_use(port: int) -> bool:
    """Whether the rendezvous store could *not* listen on ``port`` right now.

    Bound as c10d's TCPStore binds: on every address, IPv6 and IPv4 both where the machine has
    IPv6, with ``SO_REUSEADDR``, so that a port a finished job left in TIME_WAIT (a minute
    after its store closed) counts as free, as it is for the next store, and a listener on any
    one address counts as taken.
    """
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: IPv4 alone
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # and IPv4's
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue  # this family cannot bind here (no IPv6 address): the next one
                raise  # EACCES (a port below 1024 without root): the caller says so
            return False
    return False


# the port of a rendezvous endpoint given without one, by --rdzv-backend (torch 2.14: c10d's
# default_port in c10d_rendezvous_backend.py, etcd's in etcd_rendezvous.py; static has none)
ENDPOINT_PORTS = {"c10d": 29400, "etcd": 2379, "etcd-v2": 2379}


def _asked_port(env: Mapping[str, str]) -> tuple[str, int | None, str] | None:
    """``(what asked for it, the port, why it is none)`` of the port a launch here would
    listen on, if one is set; in torchrun's order (torch 2.14's run.py): ``--standalone``
    picks a free one, else the rendezvous endpoint, else ``--master-port``. torchrun reads
    each from ``PET_*`` (a flag as ``bool(int(value))``) and sets ``MASTER_PORT`` for its
    ranks itself; ``MASTER_PORT`` counts for a script started without it (``python
    script.py``, ``mp.spawn``: env://)."""
    if standalone := env.get("PET_STANDALONE", "").strip():
        if not standalone.lstrip("+-").isdigit():
            return f"PET_STANDALONE={standalone}", None, "torchrun reads it as a number: 1 or 0"
        if int(standalone):
            return None
    if endpoint := env.get("PET_RDZV_ENDPOINT", "").strip():
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        backend = env.get("PET_RDZV_BACKEND", "static").strip()
        try:
            _, port = parse_rendezvous_endpoint(endpoint, ENDPOINT_PORTS.get(backend, -1))
        except ValueError as exc:
            return f"PET_RDZV_ENDPOINT={endpoint}", None, str(exc)
        why = f"no port, and the {backend} rendezvous has no default: HOST:PORT" if port < 0 else ""
        return f"PET_RDZV_ENDPOINT={endpoint}", None if port < 0 else port, why
    for name in ("PET_MASTER_PORT", "MASTER_PORT"):
        if raw := env.get(name, "").strip():
            port = int(raw) if raw.isdigit() and 0 < int(raw) < 65536 else None
            return f"{name}={raw}", port, "" if port is not None else f"{raw!r} is no port number"
    return None


def check_port(env: Mapping[str, str]) -> Finding:
    from ddp_tutorial.distributed import free_port

    try:
        port = free_port()
    except OSError as exc:
        return Finding("port", "fail", f"cannot open a TCP port on 127.0.0.1: {exc}", "")
    if asked := _asked_port(env):
        shown, asked_port, why = asked
        if asked_port is None:
            return Finding("port", "fail", f"{shown}: {why}", "")
        try:
            taken = port_in_use(asked_port)
        except OSError as exc:
            why = f"{shown}: cannot listen on port {asked_port}: {exc.strerror}"
            return Finding("port", "fail", why, "ports below 1024 need root: pick one above")
        if taken:
            return Finding(
                "port",
                "fail",
                f"{shown}: port {asked_port} is already in use (another job?): "
                "the rendezvous would fail with EADDRINUSE",
                "pick a free port, or let torchrun choose one: torchrun --standalone",
            )
        return Finding("port", "ok", f"{shown}: port {asked_port} is free")
    if port_in_use(DEFAULT_MASTER_PORT):
        return Finding(
            "port",
            "warn",
            f"the default port {DEFAULT_MASTER_PORT} is taken: a multi-node torchrun (--nnodes "
            "above 1) given no --master-port or --rdzv-endpoint would fail on this node with "
            "'address already in use'; one node (--nnodes 1) picks a free port itself",
            f"give the job --master-port <free port> (e.g. {port}), the same on every node",
        )
    return Finding("port", "ok", f"free ports available (e.g. {port}); {DEFAULT_MASTER_PORT} free")
