"""``ddp-tutorial explain``'s catalogue, continued (harness/messages.py): how a job starts and
ends - a rank killed, torchrun signalled, the host out of memory, the rendezvous, the launch."""

from __future__ import annotations

from ddp_tutorial.harness.known import Known
from ddp_tutorial.harness.log_details import said_if, saved_before_exit
from ddp_tutorial.harness.messages_net import counts_differ

LAUNCH: tuple[Known, ...] = (
    Known(
        "killed-sigsegv",
        r"exitcode\s*:\s*-11\b|Signal 11 \(SIGSEGV\)|Fatal Python error: Segmentation fault",
        "a rank crashed in C or C++ code (a segmentation fault): torch, a CUDA library or an "
        "extension, not a Python error - with TORCH_DISTRIBUTED_DEBUG=DETAIL on a machine "
        "without a GPU, DDP's constructor itself crashes so, in most runs (torch 2.10 and "
        "2.14.1 CUDA builds, lesson 09)",
        "PYTHONFAULTHANDLER=1 (python -X faulthandler) prints the Python stack of the crash; "
        "TORCH_DISTRIBUTED_DEBUG=INFO instead of DETAIL where DDP crashes at construction",
        "09",
        detail=said_if(
            r"TORCH_DISTRIBUTED_DEBUG=DETAIL|_ddp_init_helper",
            "DETAIL, or DDP's constructor, is in this log: the known crash - use INFO there",
        ),
    ),
    Known(
        "killed-sigkill",
        r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)",
        "a rank was killed by signal 9, so it left no traceback: usually the kernel's OOM "
        "killer (host RAM), or the scheduler at a time or memory limit",
        'dmesg ("Killed process"), the job\'s memory limit; fewer DataLoader workers or '
        "ranks per node, the dataset out of each rank's RAM",
        "12",
    ),
    Known(
        "job-signalled",
        r"SignalException: Process \d+ got signal: (?:15|10|2|1|3)\b",
        "torchrun itself got a signal (15 SIGTERM, 2 SIGINT, 1 SIGHUP, 3 SIGQUIT; 10 SIGUSR1 "
        "when --signals-to-handle lists it): the job "
        "was stopped from outside (a preemption, a time limit, scancel, Ctrl-C), not by a "
        "failure of its own; torchrun then exits 1 whatever its ranks did",
        "nothing in the code: rerun the same command to resume from the last snapshot; to keep "
        "the work, save on SIGTERM and exit (lesson 08), requeue from the job script (10)",
        "08",
        detail=saved_before_exit,
    ),
    Known(
        "host-oom",
        r"Detected \d+ oom[-_ ]kill event|\bOut Of Memory\b|Killed process \d+",
        "the job hit its host RAM limit (--mem): the kernel killed a process",
        "measure RAM per node (ranks x DataLoader workers x dataset copies); a larger --mem, "
        "fewer workers, or a dataset shared rather than copied",
        "12",
    ),
    Known(
        "rendezvous-failed",
        r"RendezvousTimeoutError|RendezvousConnectionError|connect\(\) timed out|"
        r"client socket has timed out after \d+m?s while trying to connect|"
        r"client socket has failed to connect to any network address|"
        r"Timed out after \d+ seconds waiting for clients|"
        r"Timed out initializing process group in store based barrier",  # ranks missing
        "the nodes did not meet: the endpoint unreachable (wrong address or port, a "
        "firewall), nodes started too far apart, mismatched --nnodes or --rdzv-id, or "
        "--standalone on several nodes",
        "the same --rdzv-endpoint HOST:PORT, --rdzv-id and --nnodes on every node; check "
        "the port from another node (nc -zv HOST PORT); start the nodes together",
        "10",
        when=lambda text: not counts_differ(text),  # too many or too few processes: said
    ),
    Known(
        "world-never-complete",
        r"wait timeout after \d+ms, keys: /default_pg/",
        "init_process_group waited for ranks that never came: a world_size (or rank) passed "
        "by hand that is not what torchrun started (--nnodes x --nproc-per-node), or a node "
        "that never started",
        "pass neither world_size nor rank: init_process_group reads torchrun's environment; "
        "or make the launch start that many ranks",
        "10",
    ),
    Known(
        "rendezvous-closed",
        r"RendezvousClosedError",
        "this node came to a rendezvous that was closed: another node's torchrun ended the job "
        "(it failed past --max-restarts, or finished) before this one joined, or a new job "
        "reuses an old --rdzv-id",
        "read the other nodes' logs for why the job ended; start the nodes together, and give "
        "every new job a new --rdzv-id",
        "10",
    ),
    Known(
        "master-addr-ignored",
        r"master_addr is only used for static rdzv_backend",
        "--master-addr was ignored under --rdzv-backend c10d: each node waits for the "
        "others on its own",
        "--rdzv-endpoint HOST:PORT (the first node's) on every node",
        "10",
    ),
    Known(
        "not-launched",
        r"environment variable (RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|LOCAL_RANK) "
        r"expected, but not set",
        "init_process_group('env://') in a process that torchrun did not start (plain python)",
        "torchrun --nproc-per-node N script.py",
        "01",
    ),
    Known(
        "init-twice",
        r"initialize the default process group twice",
        "init_process_group ran a second time in this process: a helper that joins the group "
        "called again, or a notebook cell run twice",
        "join once (guard with dist.is_initialized()); dist.destroy_process_group() before "
        "joining again",
        "01",
    ),
)
