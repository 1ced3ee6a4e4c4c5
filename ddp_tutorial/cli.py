"""``ddp-tutorial``: the course's command line.

``ddp-tutorial env``     what this machine has and how the course will run here
``ddp-tutorial course``  execute the notebooks into build/ and print a table
``ddp-tutorial strip``   remove notebook outputs before committing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _env(args: argparse.Namespace) -> int:
    from ddp_tutorial.environment import environment_report, format_report

    report = environment_report()
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _course(args: argparse.Namespace) -> int:
    from ddp_tutorial.course import format_table, notebooks, run_course

    paths = [Path(p) for p in args.notebooks] or notebooks()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"ddp-tutorial course: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    results = run_course(paths, output_dir=args.output_dir, timeout=args.timeout)
    print()
    print(format_table(results))
    print(f"\nexecuted notebooks and HTML in {args.output_dir}/")
    return 0 if all(r.ok for r in results) else 1


def _strip(args: argparse.Namespace) -> int:
    from ddp_tutorial.course import notebooks, strip_outputs

    for path in [Path(p) for p in args.notebooks] or notebooks():
        if strip_outputs(path):
            print(f"stripped {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddp-tutorial", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the environment report (lesson 00)")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_env)
    course = sub.add_parser("course", help="execute the notebooks and print a table")
    course.add_argument("notebooks", nargs="*", help="notebooks to run (default: all)")
    course.add_argument("--output-dir", default="build", help="where executed copies go")
    course.add_argument("--timeout", type=float, default=300.0, help="seconds per cell")
    course.set_defaults(func=_course)
    strip = sub.add_parser("strip", help="strip outputs from notebooks in place")
    strip.add_argument("notebooks", nargs="*", help="notebooks (default: all)")
    strip.set_defaults(func=_strip)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
