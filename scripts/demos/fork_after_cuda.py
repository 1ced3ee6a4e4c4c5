"""A fork launcher after the parent touched CUDA: what a notebook kernel does to its GPU workers.

Lesson 01 ("From inside a notebook", GPU branch) runs this in place of the
kernel: a parent that imported torch, perhaps touched CUDA (``--touch``), then
starts workers the way Accelerate's ``notebook_launcher`` and Lightning's
``ddp_notebook`` do, by fork, each worker putting a tensor on its GPU:

    python scripts/demos/fork_after_cuda.py --touch tensor --nprocs 2

It prints one JSON line: what two checks say in the parent just before the fork
(``torch.cuda.is_initialized()``, Accelerate's check before v0.22;
``torch.cuda._is_in_bad_fork()``, Lightning's since 2.6.1), and the error the
workers raised (their traceback, which ``start_processes`` carries into the
parent's exception), or ``null``. A process that has initialised CUDA can never
fork CUDA workers again, so each ``--touch`` needs a fresh parent: this script, not the kernel.
Imports torch only (no package module), so nothing but ``--touch`` reaches CUDA.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.multiprocessing as mp
import torch.utils.data

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def adam_step() -> None:  # on the CPU: Adam's step asks the accelerator whether it is capturing
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight])
    weight.sum().backward()
    optimizer.step()


def pin_memory() -> None:  # on a machine without a GPU it warns, and pins nothing
    next(iter(torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2, pin_memory=True)))


TOUCHES = {
    "nothing": lambda: None,  # only `import torch`
    "device_count": torch.cuda.device_count,  # asks NVML first
    "is_available": torch.cuda.is_available,  # asks the CUDA runtime, unless NVML_CHECK=1
    "memory_allocated": torch.cuda.memory_allocated,  # CUDA not initialised: empty stats, 0
    "mem_get_info": torch.cuda.mem_get_info,  # asks the driver: initialises CUDA
    "tensor": lambda: torch.zeros(1, device="cuda"),  # initialises CUDA: a context on cuda:0
    # what calls is_available() for you, on the CPU too: its question goes to the CUDA runtime
    "adam_step": adam_step,  # most torch.optim steps (Adam, AdamW, RMSprop...; not SGD) in 2.14
    "pin_memory": pin_memory,  # the loader asks torch.accelerator.is_available()
    "data_parallel": lambda: torch.nn.DataParallel(torch.nn.Linear(2, 2)),  # its device type
}


def use_the_gpu(index: int) -> None:
    """One forked worker: a tensor on GPU ``index`` (initialises CUDA in the worker)."""
    torch.ones(1, device=f"cuda:{index}").add_(1)
    torch.cuda.synchronize(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--touch", choices=sorted(TOUCHES), default="nothing")
    parser.add_argument("--nprocs", type=int, default=2, help="forked workers, one GPU each")
    parser.add_argument(
        "--nvml-check", action="store_true", help=f"set {NVML_CHECK}=1 (else it is unset)"
    )
    args = parser.parse_args()
    if args.nvml_check:  # read by torch at every is_available() call
        os.environ[NVML_CHECK] = "1"
    else:
        os.environ.pop(NVML_CHECK, None)
    TOUCHES[args.touch]()
    initialized = torch.cuda.is_initialized()  # Accelerate's check before v0.22
    bad_fork = torch.cuda._is_in_bad_fork()  # Lightning's since 2.6.1: is *this* a bad fork?
    try:
        mp.start_processes(use_the_gpu, nprocs=args.nprocs, start_method="fork")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # its traceback
        error = str(exc)
    else:
        error = None
    report = {"touch": args.touch, "nvml_check": args.nvml_check, "initialized": initialized,
              "bad_fork": bad_fork, "workers": args.nprocs, "error": error}  # fmt: skip
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
