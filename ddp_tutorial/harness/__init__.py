"""Host side: code that runs around the ranks, in the notebook kernel or the shell.

It starts torchrun (``launch``, ``multinode``), explains failures
(``failures``), samples utilization (``monitor``), checks a machine
(``checks``, ``doctor``, ``environment``), executes the course (``course``),
draws figures (``plots``) and provides the ``ddp-tutorial`` command (``cli``).
A rank never imports this package.
"""
