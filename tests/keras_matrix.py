"""The Keras version matrix: the Keras-facing tests on every Keras minor release kerasfeed accepts.

``make keras-matrix`` (not part of ``make test``: about ten minutes a version on 2 cores). For each
minor release from setup.cfg's lower bound up to (not including) its upper bound, the newest patch
release on the package index gets a light virtual environment of its own that holds only that
Keras (``pip install --no-deps``) and sees the rest of the base environment (TensorFlow, JAX,
PyTorch, ...) through a ``.pth`` file; a second one over the TensorFlow-free environment serves the
JAX-without-TensorFlow test. The Keras-facing tests (GROUPS) run there, one version at a time, and
the results table replaces the one between the markers in ``docs/keras_versions.md``.

    python tests/keras_matrix.py                 # every accepted minor release
    python tests/keras_matrix.py 3.9 3.15        # some of them
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "keras_versions.md"
BEGIN, END = "<!-- keras-matrix:begin -->", "<!-- keras-matrix:end -->"
# The Keras-facing tests, by the column they fill.
GROUPS = {
    "parity": ["tests/test_keras_parity.py"],
    "Keras structure": ["tests/test_keras_private.py"],
    "crash resume": ["tests/test_crash_resume.py"],
    "backends": ["tests/backends/test_backends.py", "tests/backends/test_loader.py",
                 "tests/backends/test_loader_handover.py"],
    "skip budget": ["tests/test_skip_budget.py"],
    "BackupAndRestore": ["tests/test_backup.py", "tests/test_resume.py"],
    "Keras' own tests": ["tests/keras_upstream", "tests/backends/test_keras_own_tests.py"],
}


# Keras releases whose JAX backend calls jax.spmd_mode (gone in JAX 0.5): their venvs get the last JAX with it.
OLD_JAX = {"3.7": "0.4.38", "3.8": "0.4.38", "3.9": "0.4.38"}


def accepted_minors() -> tuple[tuple[int, int], tuple[int, int]]:
    """setup.cfg's Keras bounds: ``keras>=3.A,<3.B`` -> ((3, A), (3, B))."""
    text = (ROOT / "setup.cfg").read_text()
    found = re.search(r"^\s*keras>=(\d+)\.(\d+),<(\d+)\.(\d+)\s*$", text, re.M)
    if found is None:
        raise SystemExit("setup.cfg: expected a requirement `keras>=3.A,<3.B`")
    a, b, c, d = map(int, found.groups())
    return (a, b), (c, d)


def newest_patches(python: str, low: tuple, high: tuple) -> dict:
    """``{"3.9": "3.9.2", ...}``: the newest release of each minor in [low, high) on the index."""
    out = subprocess.run([python, "-m", "pip", "index", "versions", "keras"], capture_output=True, text=True,
                         check=True).stdout
    listed = re.search(r"Available versions: (.*)", out).group(1).split(", ")
    newest: dict = {}
    for version in listed:
        parts = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version.strip())
        if parts is None:
            continue  # pre-releases
        key = tuple(map(int, parts.groups()))
        if low <= key[:2] < high and key > newest.get(key[:2], (0, 0, 0)):
            newest[key[:2]] = key
    return {f"{k[0]}.{k[1]}": ".".join(map(str, v)) for k, v in sorted(newest.items())}


def light_venv(path: Path, base_python: str, keras: str) -> str:
    """A venv at ``path`` with only Keras ``keras`` of its own (and JAX, for ``OLD_JAX``), over
    ``base_python``'s packages."""
    python = path / "bin" / "python"
    jax = OLD_JAX.get(keras.rsplit(".", 1)[0])
    packages = [f"keras=={keras}"] + ([f"jax=={jax}", f"jaxlib=={jax}"] if jax else [])
    stamp = path / ("." + "-".join(packages).replace("==", "-"))
    if stamp.exists():
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    base = subprocess.run([base_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    # After this venv's own site-packages (its Keras wins), with the base's own .pth files processed.
    Path(own, "zz_base_environment.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    *packages], check=True)
    found = subprocess.run([str(python), "-c", "import keras; print(keras.version())"], capture_output=True,
                           text=True, check=True, env=dict(os.environ, KERAS_BACKEND="jax")).stdout.strip()
    if found != keras:
        raise SystemExit(f"{path}: imports keras {found}, not {keras}")
    stamp.touch()
    return str(python)


def run_version(keras: str, base: str, notf: str, work: Path) -> dict:
    """The GROUPS under Keras ``keras``: ``{group: {"passed", "failed", "skipped", "failures"}}``."""
    python = light_venv(work / keras, base, keras)
    notf_python = light_venv(work / f"{keras}-notf", notf, keras)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH", "PYTEST_"))}
    env.update(PYTHONPATH=str(ROOT), KERASFEED_NOTF_PYTHON=notf_python, TF_CPP_MIN_LOG_LEVEL="2")
    report = work / f"{keras}.xml"
    paths = [p for group in GROUPS.values() for p in group]
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal",
           f"--junitxml={report}", *paths]
    started = datetime.datetime.now()
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
    (work / f"{keras}.log").write_text(proc.stdout + proc.stderr)
    results = {name: {"passed": 0, "failed": 0, "skipped": 0, "failures": []} for name in GROUPS}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = _group_of(case.get("classname", ""), case.get("file"))
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        results[name][outcome] += 1
        if outcome == "failed":
            results[name]["failures"].append(f"{case.get('classname')}::{case.get('name')}")
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    return {"keras": keras, "groups": results, "exit": proc.returncode, "minutes": round(minutes, 1)}


def _group_of(classname: str, file: str | None) -> str:
    path = (file or classname.replace(".", "/")).replace("\\", "/")
    for name, paths in GROUPS.items():
        if any(p.removesuffix(".py") in path for p in paths):
            return name
    raise SystemExit(f"a test of no group: {classname}")


def table(runs: list) -> str:
    head = "| Keras | " + " | ".join(GROUPS) + " | result |"
    lines = [head, "|" + " --- |" * (len(GROUPS) + 2)]
    for run in runs:
        cells = []
        for name in GROUPS:
            g = run["groups"][name]
            total = g["passed"] + g["failed"]
            cell = f"{g['passed']}/{total}" + (f" ({g['skipped']} skipped)" if g["skipped"] else "")
            cells.append(cell if not g["failed"] else f"**{cell}**")
        failed = sum(g["failed"] for g in run["groups"].values())
        verdict = "pass" if failed == 0 and run["exit"] == 0 else f"**{failed} failed**"
        lines.append(f"| {run['keras']} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)


def write_doc(runs: list, machine: str) -> None:
    text = DOC.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    failures = [f"- Keras {r['keras']}: " + ", ".join(f for g in r["groups"].values() for f in g["failures"])
                for r in runs if any(g["failures"] for g in r["groups"].values())]
    jax = "; ".join(f"Keras {', '.join(k for k, v in OLD_JAX.items() if v == j)} with JAX {j}"
                    for j in sorted(set(OLD_JAX.values())))
    machine += f" Where a Keras release's JAX backend calls what today's JAX removed, its environment has an older JAX ({jax})."
    body = f"\n{machine}\n\n{table(runs)}\n" + ("\nFailed:\n\n" + "\n".join(failures) + "\n" if failures else "")
    DOC.write_text(text[:start] + body + text[stop:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="*", help="minor releases to run (default: every accepted one)")
    parser.add_argument("--work", default=str(ROOT / "build" / "keras-matrix"), help="venvs, logs, reports")
    parser.add_argument("--base", default=sys.executable, help="the environment with everything but Keras")
    parser.add_argument("--notf", default=os.environ.get("KERASFEED_NOTF_PYTHON", str(ROOT / ".venv-notf/bin/python")))
    args = parser.parse_args()
    low, high = accepted_minors()
    releases = newest_patches(args.base, low, high)
    chosen = args.versions or list(releases)
    unknown = [v for v in chosen if v not in releases]
    if unknown:
        raise SystemExit(f"not an accepted minor release with a release on the index: {unknown}; "
                         f"accepted: {list(releases)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "results.json"
    runs = {r["keras"]: r for r in (json.loads(saved.read_text()) if saved.exists() else [])}
    for minor in chosen:
        print(f"Keras {releases[minor]} ...", flush=True)
        run = run_version(releases[minor], args.base, args.notf, work)
        runs[run["keras"]] = run
        saved.write_text(json.dumps(sorted(runs.values(), key=_key), indent=1))
        print(table([run]), flush=True)
    ordered = [r for r in sorted(runs.values(), key=_key) if r["keras"].rsplit(".", 1)[0] in releases]
    machine = (f"Run {datetime.date.today()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"{_peers(args.base)}; each cell: tests passed / run.")
    write_doc(ordered, machine)
    print(table(ordered))


def _key(run: dict) -> tuple:
    return tuple(int(p) for p in run["keras"].split("."))


def _peers(python: str) -> str:
    code = ("import importlib.metadata as m\nfor p in ('tensorflow', 'tensorflow-cpu', 'jax', 'torch'):\n"
            "    try: print(p, m.version(p))\n    except m.PackageNotFoundError: pass")
    found = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()
    return ", ".join(found.splitlines())


if __name__ == "__main__":
    main()
