"""The rules of ``ddp-tutorial lint``: each code, what is wrong and what to do, and the lesson
that shows it; a finding as the linter prints it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

RULES: dict[str, tuple[str, str]] = {
    "DDP101": (
        "{what} inside a branch that depends on the rank: the ranks that skip it leave the "
        "others waiting in it until the timeout; call it on every rank, outside the branch",
        "09",
    ),
    "DDP102": (
        "the global rank ({name}) used as a GPU index: on every node but the first it names a "
        "GPU that does not exist; use LOCAL_RANK (int(os.environ['LOCAL_RANK']))",
        "03",
    ),
    "DDP103": (
        "DistributedSampler {name} is never given .set_epoch(epoch): every epoch reads the "
        "same order; call {fix}.set_epoch(epoch) at the top of the epoch loop",
        "02",
    ),
    "DDP104": (
        "shuffle=True beside sampler=: DataLoader refuses both; the sampler shuffles "
        "(DistributedSampler(shuffle=True) and set_epoch)",
        "02",
    ),
    "DDP105": (
        "torch.save on every rank: N processes write the same file at once (a torn file: "
        "'storage has wrong size'); save under `if rank == 0:` (the global rank)",
        "05",
    ),
    "DDP106": (
        "the save is guarded by the local rank ({name}): one writer per node, still concurrent "
        "writers on a shared disk; guard it with the global rank (dist.get_rank() == 0) - "
        "unless each node saves to a disk of its own, and every node then resumes from its own "
        "copy (# ddp-lint: ignore[DDP106])",
        "05",
    ),
    "DDP107": (
        "{name}.state_dict() of the DDP wrapper: every key gets a 'module.' prefix that a "
        "plain model refuses; save {name}.module.state_dict()",
        "05",
    ),
    "DDP108": (
        "torch.load without map_location: tensors return to the device they were saved "
        "from (every rank onto cuda:0); pass map_location='cpu' or this rank's device",
        "05",
    ),
    "DDP109": (
        "init_process_group with nccl, and neither device_id nor torch.cuda.set_device: "
        "barrier() and object collectives run on the current device, cuda:0 on every rank; "
        "pass device_id=torch.device('cuda', local_rank) (or set_device(local_rank) first)",
        "03",
    ),
    "DDP110": (
        "torch.cuda.set_device after CUDA was used on line {line}: that work (and its "
        "context) is on the previous device, usually cuda:0; call set_device first",
        "03",
    ),
    "DDP111": (
        "init_process_group without destroy_process_group: call "
        "dist.destroy_process_group() at the end (in a finally:) for a clean exit",
        "01",
    ),
    "DDP112": (
        "CUDA_VISIBLE_DEVICES set after CUDA was used on line {line}: the process already "
        "chose its GPUs and ignores it; set it before the process starts (the launcher's "
        "environment)",
        "03",
    ),
    "DDP113": (
        "{what}: torch.distributed.launch and its --local_rank argument are deprecated; start "
        "with torchrun and read int(os.environ['LOCAL_RANK'])",
        "01",
    ),
    "DDP114": (
        "find_unused_parameters=True: DDP then walks the autograd graph after every forward; "
        "keep it only for a model that really leaves parameters unused",
        "04",
    ),
    "DDP115": (
        "{name}[7:] cuts 7 characters from every key, also from keys without 'module.'; use "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')",
        "05",
    ),
    "DDP124": (
        "{name}.{how}({prefix!r}) strips characters, not a prefix: any of {chars} from the "
        "start of every key ('layer.weight' becomes 'ayer.weight'); use "
        "{name}.removeprefix({prefix!r}) or "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, {prefix!r})",
        "05",
    ),
    "DDP129": (
        "{name}.replace('module.', {new}) replaces 'module.' anywhere in a key, not only at "
        "its start: a layer whose name ends in 'module' loses part of it "
        "('fusion_module.weight' becomes 'fusion_weight'); use {name}.removeprefix('module.') "
        "or torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')",
        "05",
    ),
    "DDP116": (
        "nn.DataParallel: one process driving every GPU (and its GIL); use "
        "DistributedDataParallel, one process per GPU",
        "04",
    ),
    "DDP117": (
        "RANK set to a constant in the environment: every process started from here "
        "inherits it and believes it is that rank; pass each process its own rank",
        "01",
    ),
    "DDP118": (
        "a tqdm bar on every rank: N bars draw over one terminal; tqdm(..., disable=rank != 0)",
        "01",
    ),
    "DDP119": (
        "{name} has parameters that forward() never uses: DDP stops at the second step "
        "('Expected to have finished reduction'); remove or freeze it, or "
        "find_unused_parameters=True",
        "09",
    ),
    "DDP120": (
        "{what} has a length that depends on this rank's data: a collective on it gets "
        "different shapes on different ranks; give it a fixed length (minlength=...)",
        "09",
    ),
    "DDP121": (
        "training on a number of batches computed from the rank without Join: the rank with "
        "more batches waits in its last backward for partners that have finished; equal "
        "shards, or `with Join([model]):`",
        "09",
    ),
    "DDP122": (
        "rank 0 works alone ({what}) and the others wait for it in the next collective: "
        "longer than the timeout and they fail; prepare before init_process_group, wait on "
        "the store, or on a group made with a long timeout (dist.new_group(timeout=...); "
        "init_process_group(timeout=...) lengthens every wait, and is not flagged)",
        "02",
    ),
    "DDP123": (
        "the only save in the epoch loop is conditional and nothing saves after the loop: "
        "the last epoch's weights are never written",
        "05",
    ),
    "DDP125": (
        "DataLoader {name} trains without a sampler in a DDP script: every rank reads the "
        "whole dataset, so each epoch is world_size epochs of the same samples; give it "
        "sampler=DistributedSampler(dataset) (and set_epoch(epoch) each epoch)",
        "02",
    ),
    "DDP126": (
        "every backward() runs inside no_sync(): DDP never averages the gradients, and the "
        "ranks' weights part from the first step on, without an error; leave the last "
        "micro-batch of each step outside it (`nullcontext() if last else model.no_sync()`)",
        "04",
    ),
    "DDP127": (
        "torch.load({path}) right after rank 0's torch.save to it, and nothing waits for "
        "the write: the other ranks read the file before rank 0 has written it (an older "
        "checkpoint, a torn one, or none: FileNotFoundError); call dist.barrier() between "
        "the save and the load",
        "05",
    ),
    "DDP128": (
        "{what}, made on the CPU (line {line}), goes to a collective of an nccl group, which "
        "takes CUDA tensors only ('No backend type associated with device type cpu'); make it "
        "on this rank's GPU (device=...) or .to(device) it, or "
        "init_process_group('cpu:gloo,cuda:nccl')",
        "01",
    ),
    "DDP130": (
        "{what}(...) on a line of its own does nothing: it is a context manager, which sets "
        "the device only inside a `with` block - the current device stays cuda:0, and every "
        "rank's device-less work lands there; torch.cuda.set_device(local_rank) (or "
        "torch.accelerator.set_device_index(local_rank))",
        "03",
    ),
}
# context managers that look like setters (pytorch/examples' multinode.py: a bare
# torch.accelerator.device_index(rank), helper 138)
DEVICE_CONTEXTS = ("cuda.device", "accelerator.device_index")

COLLECTIVES = frozenset(
    "all_reduce reduce broadcast all_gather all_gather_object all_gather_into_tensor gather "
    "gather_object scatter scatter_object_list reduce_scatter reduce_scatter_tensor "
    "all_to_all all_to_all_single broadcast_object_list barrier monitored_barrier".split()
)
DIST_PREFIXES = ("dist", "torch.distributed", "distributed")
# names that say "the main rank": is_main_process(), is_master(args), args.main_rank
MAIN = re.compile(r"(main|master)_?(process|rank)|is_main|is_master")
# names that hold the world size, the same on every rank wherever it came from
WORLD = re.compile(
    r"world(_size)?|ws|size|num_replicas|num_processes|n_?procs?|nproc_per_node|n_?gpus|num_gpus",
    re.I,
)
GLOBAL_RANK_SOURCES = ("get_rank", "get_global_rank")
SLOW_WORK = re.compile(  # tokenising is; a tokenizer written or loaded is not, one trained is
    r"download|prepare|preprocess|tokeni[sz]e(?!r)|(train|build|fit)_?tokeni[sz]er|build_cache|"
    r"extract|sleep"
)
# a context manager that lets the (local) rank 0 go first, the others waiting in a barrier:
# YOLO's torch_distributed_zero_first, transformers' main_process_first, accelerate's own
RANK_ZERO_FIRST = re.compile(r"zero_first|main_process_first|rank_?0_first|main_first")
# a test of a GPU index against 0 where the index is the rank (the official tutorial's
# `self.gpu_id == 0`): a guard to the first process, as `rank == 0` is
GPU_INDEX = re.compile(r"^(gpu|gpu_id|local_gpu|device_id)$")
# torch.nn modules that hold no parameters (an activation, dropout, a loss, pooling): unused
# in forward, they leave DDP no gradient to wait for
PARAMETER_FREE = re.compile(
    r"\w*(Loss|Pool[123]d|Dropout\w*|Pad[123]d)|Identity|Flatten|Unflatten|Upsample\w*|"
    r"(Leaky|R)?ReLU6?|[GS]ELU|[CS]?ELU|SiLU|Mish|Tanh\w*|Sigmoid|Hard\w+|Soft\w+|LogSoftmax"
)
EVALUATION = re.compile(r"(^|[._])(val|valid|validation|test|eval|evaluation)(_|$)", re.I)
IGNORE = re.compile(r"#\s*ddp-lint:\s*ignore(?:\[(?P<codes>[A-Z0-9, ]+)\])?")
CUDA_STRING = re.compile(r"^cuda(:\d+)?$")
ALIASED = frozenset({"DistributedSampler", "DistributedDataParallel", "DataLoader"})  # `as X`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # ddp_kit's, repeated: lint never imports torch


@dataclass(frozen=True, order=True)
class LintFinding:
    """One mistake at one line."""

    path: str
    line: int
    code: str
    message: str = field(compare=False)

    @property
    def lesson(self) -> str:
        return RULES[self.code][1]

    def format(self) -> str:
        return f"{self.path}:{self.line}: {self.code} {self.message} (lesson {self.lesson})"
