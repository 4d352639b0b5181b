"""Interpreter exit with live kerasfeed iterators, under CPU load.

Runs ``tests/reliability_scripts/every_dataset.py exit`` (every kind of
kerasfeed dataset; 3 elements taken from a live iterator of each; the script
then ends without closing anything) ``--runs`` times, ``--parallel`` at a
time, while ``--burners`` processes keep the CPUs busy. Reports, per run, the
seconds from the script's last line to the process's end; a run passes when
that is under ``--limit`` seconds.

    python benchmarks/exit_check.py                 # 50 runs, 5 at a time, 2 burners
    python benchmarks/exit_check.py --runs 8 --parallel 8

Not part of the unit suite (the test suite runs a lean version).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "reliability_scripts" / "every_dataset.py"
BURN = "while True: pass"


def _one(env: dict, hard_timeout: float, out: dict) -> None:
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), "exit"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    out["pid"] = p.pid
    line = p.stdout.readline()  # the script's last line: every iterator is live
    printed = time.monotonic()
    try:
        p.wait(timeout=hard_timeout)
        out["exit_s"] = time.monotonic() - printed
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        out["exit_s"] = None
    out["returncode"] = p.returncode
    out["printed"] = bool(line.strip()) and p.returncode == 0


def run_batch(count: int, hard_timeout: float) -> list[dict]:
    """Starts ``count`` runs at once; each is watched by its own thread."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    results = [{} for _ in range(count)]
    threads = [threading.Thread(target=_one, args=(env, hard_timeout, r)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--parallel", type=int, default=5)
    ap.add_argument("--burners", type=int, default=2, help="busy-loop processes (default: 2, both cores)")
    ap.add_argument("--limit", type=float, default=5.0, help="seconds an exit may take")
    ap.add_argument("--hard-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    results: list[dict] = []
    try:
        while len(results) < args.runs:
            n = min(args.parallel, args.runs - len(results))
            results.extend(run_batch(n, args.hard_timeout))
            print(f"{len(results)}/{args.runs} runs done", file=sys.stderr, flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    times = [r["exit_s"] for r in results if r["exit_s"] is not None]
    passed = sum(1 for r in results if r["printed"] and r["exit_s"] is not None and r["exit_s"] < args.limit)
    summary = {
        "runs": len(results),
        "passed": passed,
        "limit_s": args.limit,
        "hung": sum(1 for r in results if r["exit_s"] is None),
        "failed_to_run": sum(1 for r in results if not r["printed"]),
        "exit_s_max": max(times) if times else None,
        "exit_s_median": sorted(times)[len(times) // 2] if times else None,
        "exit_s_sorted": [round(t, 2) for t in sorted(times)],
        "burners": args.burners,
        "parallel": args.parallel,
    }
    print(json.dumps(summary))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
