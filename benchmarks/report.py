"""The benchmark's report: markdown tables from a results dict, and the README block they fill."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, List, Optional

from benchmarks.harness import mean


def _fmt(x: Optional[float], digits: int = 0) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}"


def _rate(x: float) -> str:
    return _fmt(x, 1 if x < 100 else 0)


def _cell(r: Optional[Dict[str, Any]]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return "n/a" if r["status"] == "n/a" else "error"
    ratio = f" ({r['x_serial']:.2f}×)" if "x_serial" in r else ""
    return f"{_rate(r['batches_per_s'])}{ratio}"


def _detail_rows(rows: List[Dict[str, Any]], with_workload: bool = True) -> List[str]:
    head = (["workload"] if with_workload else []) + [
        "way", "batches/s", "× serial", "timed epoch s", "first batch s", "one-off s",
        "main CPU µs/batch", "worker CPU µs/batch", "workers × RSS (USS) MB", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r.get("workload", "")] if with_workload else []
        if r["status"] == "ok":
            ws = r.get("workers") or []
            mem = (f"{len(ws)} × {mean([w['rss_mb'] for w in ws]):.0f} "
                   f"({mean([w['uss_mb'] for w in ws]):.0f})") if ws else "–"
            cells += [r["way"], _rate(r["batches_per_s"]),
                      f"{r['x_serial']:.2f}" if "x_serial" in r else "–",
                      _fmt(r["timed_epoch_s"], 3), _fmt(r["first_batch_s"], 2), _fmt(r["one_off_s"], 2),
                      _fmt(r["main_cpu_us_per_batch"]), _fmt(r["worker_cpu_us_per_batch"]), mem,
                      f"picked {r['picked']}" if r.get("picked") else r.get("note", "")]
        else:
            cells += [r["way"], "n/a" if r["status"] == "n/a" else "error", "", "", "", "", "", "", "",
                      r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return lines


def to_markdown(res: Dict[str, Any]) -> str:
    m = res["machine"]
    wls = res["workloads"]
    rows = res["rows"]
    s = res["settings"]
    out = [
        f"### Benchmark ({'quick' if s['quick'] else 'full'} run, {res['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores_usable']} usable cores of {m['cores']}, {m['ram_gb']} GB RAM; "
        f"{m['platform']}. Python {m['python']}, TensorFlow {m['tensorflow']}, Keras {m['keras']}, "
        f"h5py {m['h5py']}, numpy {m['numpy']}, torch {m['torch'] or 'not installed'}, "
        f"kerasfeed {m['kerasfeed']}. Large copy: {m['copy_gbs']} GB/s. "
        f"Load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}.",
        "",
    ]
    if rows or res.get("h5file"):
        out += ["Batches per epoch: " + ", ".join(f"{w} {s['batches'][w]}" for w in wls)
                + f". Rate = batches / best timed epoch (epoch 2, plus up to {s['max_timed_epochs'] - 1} more "
                  f"while the timed total is under {s['min_timed_s']} s); start-up is in the detail table.", ""]
    if rows:
        out += ["#### Batches/s (× the serial loop)", "",
                "| way of feeding | " + " | ".join(wls) + " |", "| --- |" + " --- |" * len(wls)]
        for way in res["ways"]:
            by = {r["workload"]: r for r in rows if r["way"] == way["name"]}
            if by:
                out.append(f"| {way['label']} | " + " | ".join(_cell(by.get(w)) for w in wls) + " |")
        notes = sorted({r["note"] for r in rows if r["status"] != "ok" and r.get("note")})
        if notes:
            out += [""] + [f"- {n}" for n in notes]
        auto = [f"- {r['workload']}: **{r.get('picked', '?')}**. {r.get('note', '')}" for r in rows
                if r["way"] == "kerasfeed-auto" and r["status"] == "ok"]
        if auto:
            out += ["", "What kerasfeed `auto` picked, and why:", ""] + auto
        lat = res.get("latency_line")
        if lat:
            out += ["", f"5 ms latency source (io): kerasfeed threads = {lat['x_serial']:.1f}× the serial loop "
                        f"({_rate(lat['batches_per_s'])} batches/s); target ≥ 20×: "
                        f"{'met' if lat['met'] else 'NOT met'}."]
        kp = [r for r in rows if r["way"] == "kerasfeed-processes" and r["status"] == "ok"]
        if kp:
            out += ["", "#### kerasfeed processes path", "",
                    "Consumer CPU = CPU time of the whole main process (tf.data runtime, the executor's "
                    "consumer side, the loop) in the timed epoch per batch; the executor's own figure is "
                    "its consumer-side time per item as it reports it (all epochs). Worker start-up is the "
                    "executor's (spawn to ready), first batch is build + first batch of epoch 1.", "",
                    "| workload | batches/s | consumer CPU µs/batch | executor consumer µs/item "
                    "| worker CPU µs/batch | worker start-up s | first batch s "
                    "| workers | RSS per worker MB | USS per worker MB |",
                    "|" + " --- |" * 10]
            for r in kp:
                ws = r.get("workers") or []
                st = (r.get("executor") or {}).get("stats") or {}
                st = st if isinstance(st, dict) else {}
                rss = mean([w["rss_mb"] for w in ws]) if ws else st.get("rss_mb_per_worker")
                uss = mean([w["uss_mb"] for w in ws]) if ws else st.get("uss_mb_per_worker")
                out.append(f"| {r['workload']} | {_rate(r['batches_per_s'])} | {_fmt(r['main_cpu_us_per_batch'])} | "
                           f"{_fmt(st.get('consumer_us_per_item'))} | {_fmt(r['worker_cpu_us_per_batch'])} | "
                           f"{_fmt(st.get('startup_s'), 2)} | {_fmt(r['first_batch_s'], 2)} | "
                           f"{len(ws) or st.get('workers', '–')} | {_fmt(rss)} | {_fmt(uss)} |")
        out += ["", "#### Details", ""] + _detail_rows(rows)
    h5 = res.get("h5file")
    if h5:
        out += ["", "#### Gzip-chunked scene file", "",
                f"Source: {h5['source']}; {h5['batches']} batches of 8 scenes × 4096 points × 6 float32, "
                "gzip, chunks of 8 scenes.", ""]
        out += _detail_rows(h5["rows"], with_workload=False)
        if h5.get("target"):
            t = h5["target"]
            out += ["", f"kerasfeed processes = {t['x_serial']:.2f}× serial; target ≥ 1.5×: "
                        f"{'met' if t['met'] else 'NOT met'}."]
    c = res.get("classic")
    if c:
        out += ["", "#### 100 slow generators", ""]
        if c.get("status") == "ok":
            fg, kf = c["from_generator"], c["kerasfeed"]
            out += [f"Each of {c['generators']} generators sleeps {c['sleep_s']} s, then yields one "
                    f"image/mask pair.", "",
                    "| way | seconds for all | note |", "| --- | --- | --- |",
                    f"| `from_generator` over the chained generators | {fg['extrapolated_s']:.2f} | "
                    f"{fg['note']} ({fg['measured_s']:.2f} s measured) |",
                    f"| `{kf['call']}` | {kf['best_s']:.3f} | best of 2 passes |",
                    "", f"Speed-up {c['speedup']:.1f}×; target ≥ 20×: {'met' if c['target']['met'] else 'NOT met'}."]
        else:
            out.append(c.get("note", "n/a"))
    out += ["", f"Whole run: {res['elapsed_s']:.0f} s."]
    return "\n".join(out) + "\n"



README_START = "<!-- benchmark-results:start -->"
README_END = "<!-- benchmark-results:end -->"


def update_readme(path: os.PathLike, markdown: str) -> None:
    """Replaces the block between the benchmark-results markers of ``path``."""
    import re

    path = pathlib.Path(path)
    text = path.read_text()
    # The markers must stand alone on their lines (docs may quote them inline).
    block = re.compile(rf"^{re.escape(README_START)}$.*?^{re.escape(README_END)}$", re.M | re.S)
    if not block.search(text):
        raise ValueError(f"{path} has no '{README_START}' ... '{README_END}' block (each marker alone "
                         f"on its line) to replace. Received: path={str(path)!r}")
    new = f"{README_START}\n{markdown.strip()}\n{README_END}"
    path.write_text(block.sub(lambda _: new, text, count=1))


def save_chart(res: Dict[str, Any], path: os.PathLike) -> None:
    """Draws the main table as a PNG: × the serial loop per workload and way (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls, rows = res["workloads"], res["rows"]
    ways = [w for w in res["ways"] if any(r["way"] == w["name"] and r["status"] == "ok" for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 5.6))
    width = 0.8 / max(len(ways), 1)
    for k, way in enumerate(ways):
        by = {r["workload"]: r for r in rows if r["way"] == way["name"] and r["status"] == "ok"}
        xs = [i + (k - (len(ways) - 1) / 2) * width for i in range(len(wls))]
        ax.bar(xs, [by[w]["x_serial"] if w in by else 0 for w in wls], width, label=way["label"].replace("`", ""))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.set_xticks(range(len(wls)), wls)
    ax.set_xlabel("workload")
    ax.set_ylabel("batches/s, × the serial loop (log scale)")
    m = res["machine"]
    ax.set_title(f"Pipeline drain, {m['cores_usable']} cores ({m['cpu']}), {res['date'][:10]}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
