"""Helpers of single lessons: what one notebook and its demo scripts share.

``first_steps`` (00), ``collectives`` (01), ``sampling`` (02), ``device_mapping`` (03),
``anatomy`` (04), ``utilization`` (06), ``perf`` (07), ``debugging`` (09), ``cluster`` (10),
``speed`` (11): host-side analysis and figures, plus the small models, batches and hooks that
a demo and its one-process reference must share. The DDP code a lesson teaches (the
collectives, the sampler, the wrap, ``no_sync``, the timing loop, the pitfalls) lives in the
script the lesson shows (``scripts/demos/`` or ``scripts/``), where a reader copies it from.
"""
