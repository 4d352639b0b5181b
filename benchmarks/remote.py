"""Remote HDF5 benchmark: the same gzip-chunked file drained locally and from an HTTP store 20 ms away.

Run on its own: ``python benchmarks/remote.py`` (``--quick`` for a tiny run,
``--json PATH`` to keep the numbers). The store is ``tests/remote_servers.py``
run as a process of its own on 127.0.0.1 (byte ranges, ETags, a fixed
``--delay`` before every answer, ``sendfile`` for the bytes), so that it
does not share the reader's GIL. The file is ``make_synthetic_scenes``
(gzip level 4, chunks of 8 scenes); a batch is ``--batch`` scenes of
``points`` (float32, points x 6) and ``labels``.

Rows (batches/s, one pass per round after an untimed warm pass; rounds
alternate between the rows so that a busy machine slows them alike; each
timed pass follows an untimed pass of the same loader, back to back, so
that no loader times a pass it made ahead while the other rows ran):

- ``local, threads`` / ``local, processes``: ``to_loader`` over the local file;
- ``remote, threads`` / ``remote, processes`` (and ``remote, ray`` with
  ``--ray``): the same over ``http://`` (chunks fetched as byte ranges, one
  wave per batch, decoded outside h5py);
- ``h5py over fsspec``: what users do today, ``h5py.File(fsspec.open(url))``
  read batch by batch in one loop (h5py reads serially under its lock;
  fsspec's default read-ahead cache, 5 MB blocks), and the same with
  ``to_loader(executor="threads")`` over a Sequence reading that file.

Per remote row: requests per batch and bytes read per byte stored (the
server's counts for a fresh reader's construction plus one pass, the mean
of its passes 2 and 3: ``_traffic``; a pass needs every stored chunk once,
so 1.0 is the floor); the
round trips before the first batch (the file's metadata at construction,
then the first batch). Per row, the store process's CPU per batch over the
timed passes (user + system: the loopback store shares the reader's cores,
which a real store does not; see ``StoreProcess.cpu_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable, Dict, List

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


class StoreProcess:
    """``tests/remote_servers.py`` serving a directory from a process of its own."""

    def __init__(self, root: str, delay: float, procs: int = 1):
        # A process group of its own: a store of several processes (``--procs``) is stopped as one.
        self.procs = procs
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "remote_servers.py"), "--root", root, "--delay", str(delay),
             "--procs", str(procs)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """CPU seconds the store's process has used (user + system). The loopback store shares the
        reader's cores, which a real store does not; its system time includes the loopback TCP work
        that runs in the sender's context (the receiving side's too), not only the store's own."""
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def counts(self) -> Dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/__counts__", timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


class H5pyOverFsspec:
    """The usual way today: a Sequence holding ``h5py.File(fsspec.open(url).open())``."""

    def __init__(self, url: str, batch: int):
        import fsspec
        import h5py

        self._file = fsspec.open(url, "rb").open()
        self._h5 = h5py.File(self._file, "r")
        self._points, self._labels = self._h5["points"], self._h5["labels"]
        self.batch = batch
        self._n = len(self._labels) // batch

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self._points[s], self._labels[s]

    def close(self) -> None:
        # Closed before the interpreter exits: h5py objects over an fsspec file freed at shutdown hung or
        # crashed the benchmark's process there (h5py's lock, taken in a dealloc; h5py#2019's kind).
        self._h5.close()
        self._file.close()


def _stored_bytes(path: str, keys) -> int:
    import h5py

    total = 0
    with h5py.File(path, "r") as f:
        for key in keys:
            found: list = []
            f[key].id.chunk_iter(lambda info: found.append(info.size))
            total += sum(found)
    return total


def _drain(loader) -> int:
    n = 0
    for _ in loader:
        n += 1
    return n


def _first_batch(make: Callable[[], Any]) -> Dict[str, Any]:
    """Round trips to build the source (the file's metadata) and then to get batch 0."""
    from kerasfeed.remote.fetch import STATS

    STATS.reset()
    t0 = time.perf_counter()
    seq = make()
    built = STATS.as_dict()
    t1 = time.perf_counter()
    STATS.reset()
    seq[0]
    first = STATS.as_dict()
    t2 = time.perf_counter()
    return {"metadata_round_trips": built["rounds"], "metadata_requests": built["requests"] + built["stats"],
            "first_batch_round_trips": first["rounds"], "build_s": t1 - t0, "first_batch_s": t2 - t1}


def _traffic(store: StoreProcess, name: str, make: Callable, make_h5py: Callable, loader: Callable,
             stored: int) -> Dict[str, float]:
    """A fresh reader's requests per batch and bytes read per byte stored: its construction plus one pass.

    The pass is the mean of passes 2 and 3, not the first pass alone: a loader of worker processes
    starts its next pass before the last batch of a pass arrives (its in-flight depth: up to 32
    batches here), so counts taken when pass 1 ends hold part of pass 2 (the 2026-11-26 note in
    benchmarks/README.md). Between the ends of passes 1 and 3 lie two passes' reads, give or take the
    difference between what was made ahead of those two ends (for worker processes: up to ~0.2 of a pass,
    so a row's figures move by a few hundredths between runs). A per-process first read (the small
    ``labels``, fetched whole once) falls in pass 1 and so is left out: 16 KB here.
    """
    import kerasfeed

    c0 = store.counts()
    src = make_h5py() if name.startswith("h5py") else make()
    n = len(src)
    ld = None
    if name == "h5py over fsspec, loop":
        def take():
            for i in range(n):
                src[i]
    else:
        ex = name.split(", ")[1]
        ld = kerasfeed.to_loader(src, executor=ex) if name.startswith("h5py") else loader(src, ex)

        def take():
            _drain(ld)
    c1 = store.counts()
    take()
    c2 = store.counts()
    take()
    take()
    c3 = store.counts()
    if ld is not None:
        ld.close()
    requests = (c1["requests"] - c0["requests"]) + (c3["requests"] - c2["requests"]) / 2
    read = (c1["bytes"] - c0["bytes"]) + (c3["bytes"] - c2["bytes"]) / 2
    return {"requests_per_batch": requests / n, "bytes_read_per_byte_stored": read / stored}


def run(args) -> Dict[str, Any]:
    # --file-dir: the file is made once there and reused by later runs (a many-core machine's runs are
    # short next to making a large file); otherwise in a fresh temporary directory, removed however the run ends.
    if args.file_dir:
        return _run_in(args, args.file_dir)
    tmp = tempfile.mkdtemp(prefix="kf-remote-bench-")
    try:
        return _run_in(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in(args, tmp: str) -> Dict[str, Any]:
    import kerasfeed
    from kerasfeed.datasets import make_synthetic_scenes

    name = f"scenes-{args.scenes}x{args.points}.h5"
    path = os.path.join(tmp, name)
    if not os.path.exists(path):
        os.makedirs(tmp, exist_ok=True)
        made = make_synthetic_scenes(path + ".part", num_scenes=args.scenes, points_per_scene=args.points,
                                     chunk_scenes=8, seed=0)
        os.replace(made, path)
    keys = ("points", "labels")
    stored = _stored_bytes(path, keys)
    store = StoreProcess(tmp, args.delay, args.store_procs)
    url = f"{store.url}/{name}"
    counted = args.store_procs == 1  # each store process counts only its own requests
    out: Dict[str, Any] = {"delay_s": args.delay, "scenes": args.scenes, "points": args.points,
                           "store_procs": args.store_procs, "workers": args.workers,
                           "batch": args.batch, "file_bytes": os.path.getsize(path), "stored_bytes": stored}
    loaders: Dict[str, Any] = {}
    files: List[H5pyOverFsspec] = []

    def opened(f: H5pyOverFsspec) -> H5pyOverFsspec:
        files.append(f)
        return f

    try:
        out["first_batch"] = {"remote": _first_batch(lambda: kerasfeed.H5SliceSequence(url, keys, args.batch))}
        before = store.counts()["requests"]
        t0 = time.perf_counter()
        first = opened(H5pyOverFsspec(url, args.batch))
        first[0]
        trips = store.counts()["requests"] - before if counted else None
        out["first_batch"]["h5py over fsspec"] = {"round_trips": trips, "first_batch_s": time.perf_counter() - t0}

        def loader(seq, executor):
            kw = {"workers": args.workers} if executor in ("processes", "ray") else {}
            return kerasfeed.to_loader(seq, executor=executor, **kw)

        local = kerasfeed.H5SliceSequence(path, keys, args.batch)
        remote = kerasfeed.H5SliceSequence(url, keys, args.batch)
        executors = args.executors.split(",") + (["ray"] if args.ray else [])
        for ex in executors:
            loaders[f"local, {ex}"] = loader(local, ex)
            loaders[f"remote, {ex}"] = loader(remote, ex)
        if not args.no_fsspec:
            loaders["h5py over fsspec, threads"] = kerasfeed.to_loader(opened(H5pyOverFsspec(url, args.batch)),
                                                                       executor="threads")
        plain = opened(H5pyOverFsspec(url, args.batch)) if not args.no_fsspec else None
        rows: Dict[str, List[float]] = {name: [] for name in loaders}
        if not args.no_fsspec:
            rows["h5py over fsspec, loop"] = []
        store_cpu = {name: [0.0, 0] for name in rows}  # the store's CPU s and batches over the timed passes
        for name, ld in loaders.items():  # warm: workers started, connections open, caches filled
            _drain(ld)
        for i in range(len(plain) if plain is not None else 0):
            plain[i]
        for _ in range(args.rounds):
            for name in rows:
                if name != "h5py over fsspec, loop":
                    # A lead-in pass right before the timed one: a loader starts its next pass ahead, so
                    # while the other rows ran it would have made up to its in-flight depth of the timed
                    # pass (the whole pass at 32 loads per worker: "17,852 batches/s"). Back to back, the
                    # timed pass gets only what a training loop's next epoch gets.
                    _drain(loaders[name])
                t0, c0 = time.perf_counter(), store.cpu_s()
                if name == "h5py over fsspec, loop":
                    n = len(plain)
                    for i in range(n):
                        plain[i]
                else:
                    n = _drain(loaders[name])
                rows[name].append(n / (time.perf_counter() - t0))
                store_cpu[name][0] += store.cpu_s() - c0
                store_cpu[name][1] += n
                # As it goes (stderr): a run cut short by a time limit still shows what it measured.
                print(f"round {len(rows[name])}: {name}: {rows[name][-1]:.1f} batches/s", file=sys.stderr, flush=True)
        for ld in loaders.values():
            ld.close()
        loaders.clear()
        out["rows"] = {}
        for name, rates in rows.items():
            out["rows"][name] = {"batches_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                                 "rounds": rates, "requests_per_batch": None, "bytes_read_per_byte_stored": None,
                                 "store_cpu_us_per_batch": store_cpu[name][0] / store_cpu[name][1] * 1e6}
        for name in rows:
            if not name.startswith("local") and counted:
                out["rows"][name].update(_traffic(store, name, lambda: kerasfeed.H5SliceSequence(url, keys, args.batch),
                                                  lambda: opened(H5pyOverFsspec(url, args.batch)), loader, stored))
        best = {side: max((r["batches_per_s"], k) for k, r in out["rows"].items() if k.startswith(side))
                for side in ("local", "remote")}
        out["best"] = {side: {"row": k, "batches_per_s": v} for side, (v, k) in best.items()}
        out["ratio_remote_to_local"] = best["remote"][0] / best["local"][0]
        # The ratio per round (best remote row over best local row of the same round): its spread.
        per_round = [max(out["rows"][k]["rounds"][r] for k in rows if k.startswith("remote"))
                     / max(out["rows"][k]["rounds"][r] for k in rows if k.startswith("local"))
                     for r in range(args.rounds)]
        out["ratio_per_round"] = per_round
    finally:
        for ld in loaders.values():
            close = getattr(ld, "close", None)
            if close is not None:
                close()
        for f in files:
            f.close()
        store.stop()
    return out


def _table(out: Dict[str, Any]) -> str:
    lines = [
        f"delay {out['delay_s'] * 1000:.0f} ms per request; {out['scenes']} scenes x {out['points']} points, "
        f"batches of {out['batch']}; file {out['file_bytes'] / 2**20:.1f} MiB; store processes {out['store_procs']}",
        "| row | batches/s median [min-max] | requests/batch | bytes read / byte stored | store CPU us/batch |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in out["rows"].items():
        req = "-" if r["requests_per_batch"] is None else f"{r['requests_per_batch']:.2f}"
        amp = "-" if r["bytes_read_per_byte_stored"] is None else f"{r['bytes_read_per_byte_stored']:.3f}"
        lines.append(f"| {name} | {r['batches_per_s']:.1f} [{r['min']:.1f}-{r['max']:.1f}] | {req} | {amp} | "
                     f"{r['store_cpu_us_per_batch']:.0f} |")
    fb = out["first_batch"]
    rr = out["ratio_per_round"]
    lines += [
        f"best remote / best local: {out['ratio_remote_to_local']:.2f} ({out['best']['remote']['row']} / "
        f"{out['best']['local']['row']}); per round {min(rr):.2f}-{max(rr):.2f}",
        f"first batch, remote: {fb['remote']['metadata_round_trips']} round trips for the metadata "
        f"({fb['remote']['metadata_requests']} requests), then {fb['remote']['first_batch_round_trips']} for the "
        f"batch ({fb['remote']['build_s'] * 1000:.0f} ms + {fb['remote']['first_batch_s'] * 1000:.0f} ms)",
        f"first batch, h5py over fsspec: {_or_dash(fb['h5py over fsspec']['round_trips'])} round trips "
        f"({fb['h5py over fsspec']['first_batch_s'] * 1000:.0f} ms)",
    ]
    return "\n".join(lines)


def _or_dash(v: Any) -> str:
    return "-" if v is None else str(v)


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenes", type=int, default=2048)
    p.add_argument("--points", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ray", action="store_true", help="also the Ray executor (a local Ray on 127.0.0.1)")
    p.add_argument("--executors", default="threads,processes", help="the executors of the local and remote rows")
    p.add_argument("--store-procs", type=int, default=1,
                   help="the store's processes (1: requests per batch and bytes read are counted; more: not)")
    p.add_argument("--file-dir", default=None, help="make the file there once and reuse it (kept)")
    p.add_argument("--no-fsspec", action="store_true",
                   help="time no h5py-over-fsspec rows (serial: they would take most of a many-core run)")
    p.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.store_procs < 1:
        p.error(f"--store-procs must be at least 1. Received: --store-procs {args.store_procs}")
    unknown = set(args.executors.split(",")) - {"threads", "processes"}
    if unknown:
        p.error(f"--executors takes threads and processes (--ray adds Ray). Received: --executors {args.executors}")
    if args.quick:
        args.scenes, args.points, args.rounds, args.batch = 128, 64, 2, 16
    out = run(args)
    out["machine"] = _machine()
    print(_table(out))
    print(json.dumps(out))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def _machine() -> Dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}


if __name__ == "__main__":
    main()
