"""Command line: ``python -m kerasfeed demo``."""

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
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "demo":
        from kerasfeed.demo import run_demo

        run_demo(args.workdir, epochs=args.epochs, executor=args.executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
