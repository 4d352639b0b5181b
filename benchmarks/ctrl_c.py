"""Ctrl-C during ``model.fit`` never hangs: SIGINT to a training script's process group, many times.

Each run starts ``tests/reliability_scripts/ctrl_c_fit.py`` (``model.fit`` over
``to_dataset(executor="processes", workers=2, shuffle=True, seed=0)``) in a
session of its own, sends SIGINT to its whole process group (as a terminal's
Ctrl-C does: the script and its workers) at a random moment of one of three
stages, and checks that the script has exited, and no process of its group is
left, within ``--limit`` seconds (20; 80 for ``start``, ``HELD_IMPORT_S``). The stages, and the random delay after
their start:

- ``start``: 0-4 s after the script starts (imports, probing, workers starting);
- ``workers``: 0-2 s after the script printed its workers (Keras, the model,
  ``fit``'s first trace, the first batches);
- ``training``: 0-1.5 s after the first batch (mid-epoch and epoch boundaries:
  an epoch is 24 items of ~3 ms).

A run that does not end in time is a hang: every thread's Python stack is
taken (the script's faulthandler on SIGUSR1, and ``py-spy dump`` of the script
and its workers when py-spy is installed), written under ``--dump-dir``, and
the group is killed. ``--burners`` busy loops keep the CPUs busy meanwhile.

    python benchmarks/ctrl_c.py                          # 300 runs beside 2 burners (make soak-ctrl-c)
    python benchmarks/ctrl_c.py --runs 40 --burners 1

Prints a JSON report (last line): runs, hangs, runs that ended before the
SIGINT, runs that ended otherwise than by KeyboardInterrupt (``other_end``,
``crashed``), Ctrl-Cs that kerasfeed raised again after Python dropped them,
exit seconds (median, p99, max) per stage and over all. Exit status 1 on a
hang or a run that ended before its SIGINT. SIGINT is given its default action
first (a shell's background job starts with it ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "reliability_scripts" / "ctrl_c_fit.py"
STAGES = {"start": 4.0, "workers": 2.0, "training": 1.5}  # stage: the most seconds of random delay after it
LIMIT_S = 20.0
# Added to the limit of a ``start`` run: a Ctrl-C during to_dataset's import of TensorFlow is held until the import
# ends (NOTE [ Ctrl-C while TensorFlow is imported ]), which took 10-29 s beside two burners (2-4 s idle).
HELD_IMPORT_S = 60.0
_START_LIMIT_S = 180.0  # a script that never reaches its stage (a broken set-up, not a hang under test)
# Python's report of a KeyboardInterrupt it dropped (raised where exceptions are ignored).
_DROPPED = r"Exception ignored in.*\n(?:Traceback.*\n|[ \t].*\n|\s*\n)*KeyboardInterrupt"


def _group(pgid: int) -> List[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    import psutil

    left = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p.info["pid"])
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return left


def _stacks(pids: List[int], proc: subprocess.Popen) -> str:
    """Every thread's stack of a hung run: py-spy (native frames too) when installed, and the script's own
    faulthandler dump (SIGUSR1, into its stderr)."""
    out = []
    spy = shutil.which("py-spy") or (shutil.which("py-spy", path=os.path.dirname(sys.executable)))
    for pid in pids:
        if spy:
            try:
                got = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                     timeout=60)
                out.append(f"--- py-spy dump --native --pid {pid}\n{got.stdout}{got.stderr}")
            except (OSError, subprocess.TimeoutExpired) as e:
                out.append(f"--- py-spy on {pid} failed: {e!r}")
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
    except ProcessLookupError:
        pass
    return "\n".join(out)


def run_once(stage: str, delay: float, *, limit: float = LIMIT_S, dump_dir: Optional[Path] = None,
             env: Optional[dict] = None) -> Dict[str, Any]:
    """One run: SIGINT to the group ``delay`` seconds after ``stage`` began; how it ended.

    Returns a dict with ``stage``, ``delay``, ``times`` (when the stages began and the SIGINT came, in
    seconds from the start), ``exit_s`` (SIGINT to the last process of the group gone; None for a hang),
    ``limit_s`` (``limit``, plus ``HELD_IMPORT_S`` for ``start``), ``returncode``, ``ended_early`` (the script
    had ended before the SIGINT), ``interrupted`` (it ended by KeyboardInterrupt, or before Python set its
    handler up: Ctrl-C's ordinary ends), ``raised_again`` (by kerasfeed, after Python dropped it),
    ``dropped`` (Python's "Exception ignored ... KeyboardInterrupt" in its stderr), ``last_error``, ``seen``
    (the stages it reached), ``stderr`` and, for a hang, ``left`` (pids) and ``dump`` (the file with their stacks).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}. Received: stage={stage!r}")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        raise RuntimeError("SIGINT is ignored in this process, so it would be in the script too (a background "
                           "job of a shell): call default_sigint() from the main thread first. Received: SIG_IGN")
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            start_new_session=True)
    seen = {"start": time.monotonic()}
    info: Dict[str, Any] = {}
    marks = {"workers": threading.Event(), "training": threading.Event()}

    def read():
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "workers" in msg:
                info.update(msg)
                seen["workers"] = time.monotonic()
                marks["workers"].set()
            if msg.get("training"):
                seen["training"] = time.monotonic()
                marks["training"].set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if stage == "start":
        limit += HELD_IMPORT_S
    result: Dict[str, Any] = {"stage": stage, "delay": round(delay, 3), "limit_s": limit}
    ended_early = False
    try:
        if stage != "start":
            deadline = time.monotonic() + _START_LIMIT_S
            while not marks[stage].wait(0.05):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
        if stage == "start" or marks[stage].is_set():
            time.sleep(max(0.0, seen[stage] + delay - time.monotonic()))
        sent = time.monotonic()
        ended_early = proc.poll() is not None
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        exit_s = None
        while time.monotonic() < sent + limit:
            if proc.poll() is not None and not _group(proc.pid):
                exit_s = time.monotonic() - sent
                break
            time.sleep(0.02)
        result["exit_s"] = None if exit_s is None else round(exit_s, 3)
        # When each stage began and the SIGINT came, in seconds since the start.
        result["times"] = {k: round(v - seen["start"], 2) for k, v in dict(seen, sigint=sent).items() if k != "start"}
        if exit_s is None:
            left = _group(proc.pid)
            result["left"] = left
            stacks = _stacks(left, proc)
            if dump_dir is not None:
                dump_dir.mkdir(parents=True, exist_ok=True)
                path = dump_dir / f"hang-{os.getpid()}-{proc.pid}.txt"
                err.seek(0)
                path.write_text(f"{json.dumps(dict(result, info=info, seen=sorted(seen)))}\n{stacks}\n"
                                f"--- the script's stderr (faulthandler dump last)\n{err.read()}")
                result["dump"] = str(path)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(5)
        proc.stdout.close()
    err.seek(0)
    text = err.read()
    err.close()
    result["returncode"] = proc.returncode
    result["seen"] = sorted(seen, key=list(STAGES).index)
    result["ended_early"] = ended_early
    # Ctrl-C's ordinary ends: Python's KeyboardInterrupt (traceback, then exit by SIGINT), or SIGINT's
    # default action before Python set its handler up (the first milliseconds).
    result["interrupted"] = result["exit_s"] is not None and (
        "KeyboardInterrupt" in text or (proc.returncode == -signal.SIGINT and not text.strip()))
    # Raised again by kerasfeed after Python dropped it (NOTE [ A Ctrl-C that Python swallows ]).
    result["raised_again"] = "execution/interrupts.py" in text and "in again" in text
    result["dropped"] = re.search(_DROPPED, text) is not None
    errors = [line for line in text.splitlines() if line[:1].isalpha() and ("Error" in line.split(":")[0] or
                                                                            line.startswith("KeyboardInterrupt"))]
    result["last_error"] = errors[-1][:300] if errors else ""
    result["stderr"] = text
    return result


def _quantile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summary(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Counts and exit-time figures of ``results`` (``run_once``'s dicts)."""

    def figures(rs):
        times = [r["exit_s"] for r in rs if r["exit_s"] is not None]
        return {"runs": len(rs), "hangs": sum(r["exit_s"] is None for r in rs),
                "ended_early": sum(r["ended_early"] for r in rs),
                "other_end": sum(r["exit_s"] is not None and not r["interrupted"] and not r["ended_early"] for r in rs),
                # of those, killed by a signal other than SIGINT (e.g. SIGSEGV in an extension's init)
                "crashed": sum(r["exit_s"] is not None and r["returncode"] < 0 and r["returncode"] != -signal.SIGINT
                               for r in rs),
                "raised_again": sum(r["raised_again"] for r in rs), "dropped": sum(r["dropped"] for r in rs),
                "exit_s_median": _quantile(times, 0.5), "exit_s_p99": _quantile(times, 0.99),
                "exit_s_max": max(times) if times else None}

    out = figures(results)
    out["per_stage"] = {s: figures([r for r in results if r["stage"] == s]) for s in STAGES}
    out["dumps"] = [r["dump"] for r in results if r.get("dump")]
    keys = ("stage", "delay", "times", "exit_s", "returncode", "last_error")
    out["unusual"] = [{k: r.get(k) for k in keys} for r in results
                      if r["exit_s"] is None or not r["interrupted"] or r["dropped"]][:20]
    return out


def soak(runs: int, burners: int, parallel: int, limit: float, dump_dir: Path, seed: int) -> Dict[str, Any]:
    rng = random.Random(seed)
    plan = [(stage, rng.uniform(0.0, STAGES[stage])) for stage in (rng.choice(list(STAGES)) for _ in range(runs))]
    load_before = [round(x, 2) for x in os.getloadavg()]
    hot = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    results: List[Dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def worker():
        while True:
            with lock:
                if not plan:
                    return
                stage, delay = plan.pop(0)
            r = run_once(stage, delay, limit=limit, dump_dir=dump_dir)
            with lock:
                results.append(r)
                hung = sum(x["exit_s"] is None for x in results)
                print(f"{len(results)}/{runs} runs, {hung} hung; {stage} +{delay:.2f} s: "
                      f"exit {r['exit_s']} s rc={r['returncode']}", file=sys.stderr, flush=True)

    try:
        threads = [threading.Thread(target=worker) for _ in range(parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for b in hot:
            b.kill()
            b.wait()
    out = summary(results)
    out.update(burners=burners, parallel=parallel, limit_s=limit, seed=seed, cpus=os.cpu_count(),
               load_before=load_before, minutes=round((time.monotonic() - t0) / 60, 1), date=time.strftime("%Y-%m-%d"),
               python=sys.version.split()[0])
    return out


def default_sigint() -> None:
    """Children start with SIGINT's default action, as a terminal's foreground job does. A shell
    starts a background job (``make soak-ctrl-c &``, nohup) with SIGINT ignored, and an ignored
    signal stays ignored across exec: the scripts would never see the SIGINT (a false hang)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Optional[List[str]] = None) -> int:
    default_sigint()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--burners", type=int, default=2, help="busy-loop processes beside the runs (2: both cores)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time")
    ap.add_argument("--limit", type=float, default=LIMIT_S, help="seconds from the SIGINT to the group's end")
    ap.add_argument("--seed", type=int, default=0, help="draws the stages and delays")
    ap.add_argument("--dump-dir", type=Path, default=Path(tempfile.gettempdir()) / "kerasfeed-ctrl-c")
    args = ap.parse_args(argv)
    report = soak(args.runs, args.burners, args.parallel, args.limit, args.dump_dir, args.seed)
    print(json.dumps(report))
    return 0 if report["hangs"] == 0 and report["ended_early"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
