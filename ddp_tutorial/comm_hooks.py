"""Gradient compression for DDP: which communication hook ``--comm-hook`` registers.

DDP all_reduces every gradient bucket in float32. A communication hook
replaces that all_reduce: ``fp16``/``bf16`` halve the bytes on the wire
(each rank casts its bucket, the sum travels in 16 bits, the result is cast
back), ``powersgd`` sends low-rank factors of each gradient matrix and keeps
the compression error to add back next step (error feedback). Worth it when
the network, not the GPU, is the bottleneck (many nodes, no InfiniBand);
lesson 11 measures what each one changes.

PowerSGD starts compressing at ``start_powerSGD_iter`` (1000 here, its
documented default: a warm-up of exact all_reduces keeps early training
stable); before that it *is* the plain all_reduce. Its error-feedback
buffers are not part of a template snapshot: a resume restarts them.
"""

from __future__ import annotations

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
COMM_HOOKS = kit.COMM_HOOKS
comm_hook = kit.comm_hook
