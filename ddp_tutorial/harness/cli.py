"""ddp-tutorial: the course's command line.

``ddp-tutorial env``     what this machine has and how the course will run here
``ddp-tutorial course``  execute the notebooks into build/ and print a table
``ddp-tutorial strip``   remove notebook outputs before committing
``ddp-tutorial doctor``  check this machine before training (exit status 1 if something blocks it)
``ddp-tutorial check NN`` check your answers to lesson NN's exercises (1: a mistake, named)
``ddp-tutorial lint FILE...`` the classic DDP mistakes in training scripts, read from the code
``ddp-tutorial explain LOG`` what the DDP/torchrun/NCCL/gloo messages in a log mean, and the fix
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def _env(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.environment import environment_report, format_report

    report = environment_report()
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _course(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.course import notebooks, results_table, run_course, write_index

    paths = [Path(p) for p in args.notebooks] or notebooks()
    if not paths:
        print("ddp-tutorial course: no lesson notebooks found (run it from a checkout of the "
              "repository: notebooks/ beside ddp_tutorial/)", file=sys.stderr)  # fmt: skip
        return 2
    if not _readable_notebooks("course", paths):
        return 2
    results = run_course(paths, output_dir=args.output_dir, timeout=args.timeout)
    index = write_index(results, args.output_dir)
    print()
    print(results_table(results))
    print(f"\nexecuted notebooks and HTML in {args.output_dir}/; read them from {index}")
    return 0 if all(r.ok for r in results) else 1


def _readable_notebooks(command: str, paths: list[Path]) -> bool:
    """Every path is a notebook file that parses; else say which is not, on stderr."""
    import nbformat

    for path in paths:
        if not path.is_file():
            problem = "no such notebook"
        else:
            try:
                nbformat.read(path, as_version=4)
                continue
            except Exception as exc:  # not JSON, not a notebook, unreadable: said, not raised
                problem = f"not a notebook ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        print(f"ddp-tutorial {command}: {path}: {problem}", file=sys.stderr)
        return False
    return True


def _strip(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.course import notebooks, strip_outputs

    paths = [Path(p) for p in args.notebooks] or notebooks()
    if not _readable_notebooks("strip", paths):
        return 2
    for path in paths:
        if strip_outputs(path):
            print(f"stripped {path}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.doctor import (
        exit_code,
        format_finding,
        format_findings,
        run_checks,
        to_json,
    )

    def show(finding: Any) -> None:  # one line per check as it completes (launches take seconds)
        if not args.json:
            print(format_finding(finding), flush=True)

    findings = run_checks(
        launch=not args.no_launch,
        timeout=args.timeout,
        progress=show,
        plan={"workers": args.num_workers, "dataset_gib": args.dataset_gib},
    )
    print(to_json(findings) if args.json else format_findings(findings).splitlines()[-1])
    return exit_code(findings)


def _check(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.exercise_check import main

    return main(args.lesson, args.files, solution=args.solution)


def _lint(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.lint import main

    return main(args.files)


def _explain(args: argparse.Namespace) -> int:
    from ddp_tutorial.harness.explain import main

    return main(args.logs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp-tutorial", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the environment report (lesson 00)")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_env)
    course = sub.add_parser("course", help="execute the notebooks and print a table")
    course.add_argument("notebooks", nargs="*", default=[], help="notebooks to run (default: all)")
    course.add_argument("--output-dir", default="build", help=(
        "where executed copies go (default: build, in the current folder)"))  # fmt: skip
    course.add_argument("--timeout", type=_at_least(float, 0, above=True), default=300.0,
                        help="seconds per cell")  # fmt: skip
    course.set_defaults(func=_course)
    strip = sub.add_parser("strip", help="strip outputs from notebooks in place")
    strip.add_argument("notebooks", nargs="*", default=[], help="notebooks (default: all)")
    strip.set_defaults(func=_strip)
    doctor = sub.add_parser("doctor", help="check this machine before training")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--no-launch", action="store_true", help="skip the gloo/nccl all_reduce launches"
    )
    doctor.add_argument("--timeout", type=_at_least(float, 0, above=True), default=90.0,
                        help="seconds per probe launch")  # fmt: skip
    doctor.add_argument("--num-workers", type=_at_least(int, 0), default=4, help=(
        "DataLoader workers per rank you plan, for the memory check (default 4, a common "
        "choice; the template's own default is 0)"))  # fmt: skip
    doctor.add_argument("--dataset-gib", type=_at_least(float, 0), help=(
        "GiB of dataset (or index) each rank holds in memory"))  # fmt: skip
    doctor.set_defaults(func=_doctor)
    check = sub.add_parser("check", help="check your answers to a lesson's exercises")
    check.add_argument("lesson", help="the lesson (01) or one exercise by name (01_ring_average)")
    check.add_argument("files", nargs="*", default=[], help=(
        "your files, each named after its exercise (05_exact_resume.py) or keeping its stub's "
        "first line (default: the stubs in scripts/exercises/)"))  # fmt: skip
    check.add_argument("--solution", action="store_true", help="check the reference answers")
    check.set_defaults(func=_check)
    lint = sub.add_parser("lint", help="find the classic DDP mistakes in training scripts")
    lint.add_argument(
        "files", nargs="*", default=[], help="Python files or folders to read (nothing runs)"
    )
    lint.set_defaults(func=_lint)
    explain = sub.add_parser("explain", help="explain the DDP error messages in a log")
    explain.add_argument(
        "logs", nargs="*", default=[], help="log files (default, or -: standard input)"
    )
    explain.set_defaults(func=_explain)
    return parser


def _at_least(kind: type, low: float, above: bool = False) -> Any:
    """An argparse type: ``kind`` of the text, refused below ``low`` (``above``: at ``low``
    too) with argparse's message."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):  # float("nan"), float("inf"): no amount of memory
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} is {'not above' if above else 'below'} {low:g}"
            )
        return value

    return convert


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `ddp-tutorial explain job.log | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
