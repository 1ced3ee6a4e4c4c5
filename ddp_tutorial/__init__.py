"""ddp-tutorial: the helper package behind the executable DDP course.

Three kinds of code, one folder each:

* ``ddp_tutorial/`` itself is the **rank side**, what every torchrun worker may
  import: ``distributed`` joins the process group, ``devices`` maps GPUs without
  touching CUDA, ``data``/``models`` feed and build, ``checkpoint`` makes files
  safe, ``snapshots`` holds what a resume needs, ``records`` carries per-rank
  results back, ``settings`` names every environment variable the course reads.
* ``ddp_tutorial.harness`` is the **host side**: launching, watching, reporting.
* ``ddp_tutorial.lessons`` holds helpers of single lessons.

This file imports nothing, so that a rank pays for none of it.
"""

__version__ = "0.1.0"
