"""scripts/minimal_ddp.py, resumable: snapshots, an exact resume, exact evaluation, best.pt.

    torchrun --standalone --nproc-per-node 2 scripts/resumable_ddp.py --checkpoint-dir checkpoints

Run it again with the same --checkpoint-dir and it continues from its newest snapshot, at
the step it reached, ending with the weights an uninterrupted run ends with (bitwise on 2
ranks; on more, to rounding: lesson 08). On SIGTERM (a preemption; torchrun forwards it to
every rank) every rank saves at the end of the step under way and exits 75 (one that comes
during an evaluation: after it, at the next step's end; the whole must fit torchrun's 30 s
grace, --shutdown-timeout; train.py also stops inside an evaluation); a loss gone inf or nan,
or weights before a save or an evaluation, stop every rank (exit 1) and save nothing over the
last good snapshot. A resume with other flags is refused. Global rank 0 writes every file,
atomically. Only torch and the standard library: copy it. The middle rung between
minimal_ddp.py and the template, train.py.
"""

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init: destroy_process_group can free the group
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, seed: int) -> TensorDataset:
    """n points in 20 dimensions, 4 classes given by a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=torch.Generator().manual_seed(0))).argmax(dim=1)
    return TensorDataset(x, y)


def atomic_save(obj: object, path: Path) -> None:
    """Write aside, fsync, rename: the file is always the old one or the new one, never half."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # only its own
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def positive(text: str) -> int:  # --epochs 0 would train nothing, and say nothing
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def rate(text: str) -> float:  # nan, inf or <= 0 would train on as if nothing were wrong
    if not 0 < float(text) < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return float(text)


def stop_if_diverged(model: nn.Module, device: torch.device, step: int) -> None:  # a collective
    """Weights (or BatchNorm statistics) inf or nan on a rank: every rank stops, saving nothing."""
    bad = any(not t.isfinite().all() for t in model.state_dict().values())
    flag = torch.tensor([float(bad)], device=device)
    dist.all_reduce(flag)
    if flag.item():
        dist.destroy_process_group()
        sys.exit(f"step {step}: weights inf or nan on a rank (lower --lr); nothing saved")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive, default=3)
    p.add_argument("--batch-size", type=positive, default=32, help="PER PROCESS: x ranks = global")
    p.add_argument("--lr", type=rate, default=0.05)
    p.add_argument("--num-samples", type=positive, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints", help="snapshot.pt, best.pt, final.pt")
    p.add_argument("--save-every", type=int, default=0, help="epoch ends, and every N steps if > 0")
    args = p.parse_args()
    if args.save_every < 0:
        p.error(f"argument --save-every: 0 (epoch ends only) or more, got {args.save_every}")
    ckpt = Path(args.checkpoint_dir)

    if "LOCAL_RANK" not in os.environ:
        sys.exit("start me with torchrun: torchrun --standalone --nproc-per-node 2 " + sys.argv[0])
    rank = int(os.environ["RANK"])  # 0 ... world_size-1, unique in the whole job
    local_rank = int(os.environ["LOCAL_RANK"])  # 0 ... on this machine: picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])  # processes in the job, all machines
    # nccl when every process on this machine can have a GPU of its own; else gloo, on the CPU
    backend = "nccl" if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)  # before anything touches CUDA
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    received = []  # the handler only takes note: saving happens at a step, on every rank
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    ckpt.mkdir(parents=True, exist_ok=True)

    if rank == 0:
        print(f"{world_size} processes, global batch {args.batch_size * world_size}", flush=True)

    train_set, val_set = make_data(args.num_samples, args.seed), make_data(500, args.seed + 1)
    sampler = DistributedSampler(train_set, seed=args.seed)  # rank r: every world_size-th sample
    # generator=: each iterator draws a seed from it, not from the global stream a resume restores
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, generator=torch.Generator())
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 256)  # no pad

    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    # DDP copies rank 0's weights to every rank now, and averages the gradients in backward()
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch, start_batch, step, best = 0, 0, 0, -1.0
    resumed_sum = torch.zeros(2, device=device)  # the resumed epoch's loss sums so far
    resume = [(ckpt / "snapshot.pt").is_file()]  # rank 0 decides: a rank that cannot see
    dist.broadcast_object_list(resume, src=0)  # its file fails to load it, never starts afresh
    if resume[0]:  # resume: every rank reads the file rank 0 wrote
        state = torch.load(ckpt / "snapshot.pt", map_location=device, weights_only=True)
        if len(state["rng"]) != world_size:  # each rank's batches and streams: not remappable
            raise SystemExit(f"{ckpt}/snapshot.pt was written by {len(state['rng'])} processes: "
                             "resume with as many (train.py's own snapshots resume on any "
                             "number; it cannot read this one)")  # fmt: skip
        if changed := [k for k, v in state.get("flags", {}).items() if getattr(args, k) != v]:
            raise SystemExit(f"{ckpt}/snapshot.pt was written with other {', '.join(changed)}: "
                             "resume with the same flags or a new --checkpoint-dir")  # fmt: skip
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, start_batch, step = state["epoch"], state["batch"], state["step"]
        best = state["best"]
        cpu_rng, *gpu_rng = state["rng"][rank]  # its own streams (CPU tensors, always)
        torch.set_rng_state(cpu_rng.cpu())
        if gpu_rng:  # dropout on a GPU draws from the GPU's generator
            torch.cuda.set_rng_state(gpu_rng[0].cpu())
        if rank == 0:  # every rank's sums in one: counted once, by the epoch's all_reduce
            resumed_sum = state["loss_sum"]
            print(f"resumed: epoch {start_epoch}, batch {start_batch}, step {step}", flush=True)
        del state  # its weights are in the model now: not a second copy on the GPU all run

    flags = {k: getattr(args, k) for k in ("batch_size", "lr", "num_samples", "seed")}  # saved

    def save_snapshot(epoch: int, batch: int, loss_sum: torch.Tensor) -> None:  # a collective
        stop_if_diverged(model.module, device, step)  # a step can overflow after a finite loss
        rngs = [None] * world_size
        cuda = [torch.cuda.get_rng_state()] if device.type == "cuda" else []
        dist.all_gather_object(rngs, [torch.get_rng_state(), *cuda])  # every rank's streams
        loss_sum = loss_sum.clone()
        dist.all_reduce(loss_sum)  # the epoch's loss so far: its log line survives a resume
        if rank == 0:  # one writer, in the whole job
            atomic_save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "batch": batch, "step": step, "best": best,
                         "loss_sum": loss_sum, "rng": rngs, "flags": flags},
                        ckpt / "snapshot.pt")  # fmt: skip
        dist.barrier()  # nobody reads (or exits) before the file is there

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch
        loss_sum = resumed_sum if epoch == start_epoch else torch.zeros(2, device=device)
        for batch, (x, y) in enumerate(loader):
            if epoch == start_epoch and batch < start_batch:
                continue  # done before the snapshot: the same order, skipped
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=device)])
            stop = torch.tensor([len(received), not loss.isfinite()], device=device).float()
            dist.all_reduce(stop)  # a signal (or inf/nan) on any rank stops every rank, this step
            if stop[1]:  # diverged: the last snapshot stays the last good one
                dist.destroy_process_group()
                sys.exit(f"step {step}: loss inf or nan on a rank (lower --lr); nothing saved")
            if stop[0] or args.save_every and step % args.save_every == 0:
                save_snapshot(epoch, batch + 1, loss_sum)
            if stop[0]:
                if rank == 0:
                    print(f"SIGTERM: saved step {step}, exit 75: rerun to resume", flush=True)
                dist.destroy_process_group()
                sys.exit(75)  # EX_TEMPFAIL: each rank's status (torchrun itself exits 1)
        dist.all_reduce(loss_sum)  # every rank's sums: the loss over the whole epoch
        for buffer in model.module.buffers():  # BatchNorm's statistics differ per rank: one
            dist.all_reduce(buffer)  # model, their mean (lesson 04), the one best.pt saves
            buffer.copy_(buffer / world_size)  # copy_: an integer count stays an integer
        stop_if_diverged(model.module, device, step)  # no best.pt of inf or nan weights
        model.eval()
        counts = torch.zeros(2, device=device, dtype=torch.float64)  # [correct, samples], exact
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                right = (model.module(x).argmax(1) == y).sum()
                counts += torch.stack([right, torch.tensor(len(y), device=device)])
        model.train()
        dist.all_reduce(counts)  # every sample counted once: the global accuracy, on every rank
        accuracy = (counts[0] / counts[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {(loss_sum[0] / loss_sum[1]).item():.4f}, "
                  f"val accuracy {accuracy:.1%}", flush=True)  # fmt: skip
        if accuracy > best:  # the same number on every rank: every rank agrees to save
            best = accuracy
            if rank == 0:
                atomic_save(model.module.state_dict(), ckpt / "best.pt")
        save_snapshot(epoch + 1, 0, torch.zeros(2, device=device))  # the next epoch: none yet

    if rank == 0:  # one writer; model.module: the weights without DDP's "module." prefix
        atomic_save(model.module.state_dict(), ckpt / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
