"""Helpers of single lessons: what one notebook and its scripts share.

``first_steps`` (00), ``collectives`` (01), ``sampling`` (02), ``device_mapping`` (03),
``anatomy`` and ``pitfalls`` (04), ``utilization`` (06), ``perf`` (07), ``debugging`` (09),
``cluster`` (10), ``speed`` (11). They may use both the rank side and the host side; the rank
side never imports them.
"""
