"""kerasfeed benchmark: every way of feeding the four workloads (docs/field_notes.md, *Four workloads*), in one run.

Run ``make bench`` (or ``python benchmarks/run.py``); ``--quick`` for a small
run. It prints markdown tables of batches/s and the ratio to a plain serial
loop, with the machine and the date, and writes
``benchmarks/results/latest.json`` and ``latest.md``. See
``benchmarks/README.md`` for what each row measures.

The harness (timing one configuration) is ``harness.py``, the sections and
``run_benchmark`` are ``sections.py``, the markdown report ``report.py``; this
module is the command line and keeps the names notebooks and tests import.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

from benchmarks import workloads  # noqa: E402
from benchmarks.harness import DEFAULT_OUTPUT_DIR, SECTIONS  # noqa: E402
from benchmarks.report import README_END, README_START, save_chart, to_markdown, update_readme  # noqa: E402
from benchmarks.sections import run_benchmark  # noqa: E402

__all__ = ["run_benchmark", "to_markdown", "update_readme", "README_START", "README_END", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                        help="comma-separated, among cpu,h5,io,big")
    parser.add_argument("--only", default=None,
                        help="comma-separated way names, e.g. kerasfeed-threads,keras-threads "
                             "(serial always runs); 'classic' selects the 100 slow generators")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch for every workload")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes for kerasfeed processes and PyTorch (default 2)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated among main,h5file,classic")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="do not run: re-render the markdown of a saved results JSON")
    parser.add_argument("--update-readme", metavar="PATH", action="append", default=[],
                        help=f"replace the {README_START} ... {README_END} block of PATH with the "
                             "results (repeatable), e.g. benchmarks/README.md")
    parser.add_argument("--chart", metavar="PNG", default=None, help="also draw the main table as a PNG chart")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    if args.render:
        res = json.loads(pathlib.Path(args.render).read_text())
        res["markdown"] = to_markdown(res)
    else:
        try:
            res = run_benchmark(quick=args.quick, workloads_=split(args.workloads),
                                only=split(args.only) if args.only else None, batches=args.batches,
                                process_workers=args.workers, sections=split(args.sections),
                                output_dir=args.output_dir)
        except ValueError as e:
            parser.error(str(e))
        print(f"Wrote {pathlib.Path(args.output_dir) / 'latest.json'} and latest.md")
    print()
    print(res["markdown"])
    if args.chart and res.get("rows"):
        save_chart(res, args.chart)
        print(f"Drew {args.chart}")
    for path in args.update_readme:
        update_readme(path, res["markdown"])
        print(f"Updated the results block of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

