"""Command line: python -m kerasfeed demo | profile MODULE:FACTORY."""

from __future__ import annotations

import argparse
import os
import sys

_DESCRIPTION = """\
kerasfeed: fast custom Python data loading for Keras and tf.data.

commands:
  demo      train a point-cloud classifier from a synthetic HDF5 file: through
            Keras' own loader, then through kerasfeed on threads and on worker
            processes, and show which executor ran and why
  profile   time your source serially, on threads and on worker processes, and
            recommend a set-up

Run "python -m kerasfeed COMMAND --help" for the options of a command.
TensorFlow's start-up log lines are hidden; set TF_CPP_MIN_LOG_LEVEL=0 to see them."""


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m kerasfeed", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", formatter_class=formatter,
        help="train a point-cloud classifier from a synthetic HDF5 file, three ways",
        description="Train a small PointNet on a synthetic HDF5 scene file through model.fit(seq) and "
        "model.fit(kerasfeed.to_dataset(seq)) on threads and on worker processes; print loss, accuracy, "
        "batches/s and which executor ran and why.",
    )
    demo.add_argument("--workdir", default=None,
                      help="where to write the scene file (default: $KERASFEED_CACHE or a temp directory)")
    demo.add_argument("--epochs", type=int, default=6, help="training epochs of each run")
    demo.add_argument("--executor", default="auto", choices=["auto", "threads", "processes"],
                      help="executor of the first to_dataset run (the second run uses the other one)")
    prof = sub.add_parser(
        "profile", formatter_class=formatter,
        help="time a source serially, on threads and on worker processes; classify it and recommend a setup",
        description="Time a source serially, on threads and on worker processes; classify it "
        "(waiting, GIL-bound, GIL-releasing) and recommend an executor and worker count.",
    )
    prof.add_argument("target", metavar="MODULE:FACTORY",
                      help="a module (importable, or a .py file) and a callable returning the source "
                      "(or the source itself)")
    prof.add_argument("--items", type=int, default=None, help="items per timed run (default: min(len, 64))")
    prof.add_argument("--batch-size", type=int, default=None, help="items per batch when items are samples")
    prof.add_argument("--workers", default=None, help="worker process counts, e.g. 1,2,4")
    prof.add_argument("--threads", default=None, help="thread counts, e.g. 1,4,16,64")
    prof.add_argument("--chart", default="kerasfeed_profile.png", help="where to save the chart ('' for none)")
    prof.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.command == "demo":
        from kerasfeed._demo_args import check_demo_arguments

        try:  # before TensorFlow's import (seconds)
            check_demo_arguments(args.workdir, epochs=args.epochs, executor=args.executor)
        except ValueError as e:
            parser.error(str(e))
        from kerasfeed._quiet import import_tensorflow_quietly

        import_tensorflow_quietly()  # before anything else imports TensorFlow
        from kerasfeed.demo import run_demo

        run_demo(args.workdir, epochs=args.epochs, executor=args.executor)
    elif args.command == "profile":
        from kerasfeed.observe.cli import run_profile

        return run_profile(parser, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
