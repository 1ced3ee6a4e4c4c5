"""ddp-tutorial: the helper package behind the executable DDP course.

Modules have one job each (see the README's layout): ``distributed`` joins the
process group, ``devices`` maps GPUs without touching CUDA, ``launch`` runs
scripts under the real torchrun, ``records`` carries per-rank results back,
``course`` executes the notebooks, ``environment`` reports what the machine has.
"""

__version__ = "0.1.0"
