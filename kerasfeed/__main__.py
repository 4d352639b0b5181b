"""Command line: ``python -m kerasfeed demo`` and ``python -m kerasfeed profile MODULE:FACTORY``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kerasfeed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a point-cloud classifier from a synthetic HDF5 file, two ways")
    demo.add_argument("--workdir", default=None, help="where to write the scene file (default: a temp cache)")
    demo.add_argument("--epochs", type=int, default=6)
    demo.add_argument("--executor", default="threads", help="to_dataset executor")
    prof = sub.add_parser(
        "profile",
        help="time a source serially, on threads and on worker processes; classify it and recommend a setup",
    )
    prof.add_argument("target", metavar="MODULE:FACTORY",
                      help="a module (importable, or a .py file) and a callable returning the source (or the source itself)")
    prof.add_argument("--items", type=int, default=None, help="items per timed run (default: min(len, 64))")
    prof.add_argument("--batch-size", type=int, default=None, help="items per batch when items are samples")
    prof.add_argument("--workers", default=None, help="worker process counts, e.g. 1,2,4")
    prof.add_argument("--threads", default=None, help="thread counts, e.g. 1,4,16,64")
    prof.add_argument("--chart", default="kerasfeed_profile.png", help="where to save the chart ('' for none)")
    prof.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "demo":
        from kerasfeed.demo import run_demo

        run_demo(args.workdir, epochs=args.epochs, executor=args.executor)
    elif args.command == "profile":
        from kerasfeed.observe.cli import run_profile

        return run_profile(parser, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
