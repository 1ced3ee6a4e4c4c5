"""The learner's exercises: what each one asks, how a rank runs it, how its result is judged.

Every lesson ends with "Your turn": a short file in ``scripts/exercises/`` the learner edits,
and a reference answer in ``scripts/exercises/solutions/``. ``ddp-tutorial check NN`` runs the
learner's file the way the lessons run their own (real ``torchrun``, gloo ranks) and names the
mistake it finds, in the lesson's words. This package is the rank side of that check: one
module per lesson (``lessonNN.py``) lists its :class:`Exercise` objects; ``runner`` is what
torchrun starts. The host side (launch, verdicts, the notebook's display) is
``ddp_tutorial.harness.exercise_check``.
"""
