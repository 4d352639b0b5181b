"""Markdown from result rows: the shared table cells (rounds: median and range), the drain
benchmark's report (``run.py``), the README results block and the chart."""

from __future__ import annotations

import os
import pathlib
import re
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.runner import mean

README_START = "<!-- benchmark-results:start -->"
README_END = "<!-- benchmark-results:end -->"


def fmt(x: Optional[float], digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def rate(x: float) -> str:
    return fmt(x, 1 if x < 100 else 0)


def cell(runs: List[Dict[str, Any]], key: str = "ratio") -> str:
    """One configuration's rows (one per round): ``rate (ratio×)``; several rounds:
    ``median rate (median ratio×; min–max)``; a skipped way says why."""
    if not runs:
        return ""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        first = runs[0]
        return first.get("note", "skipped") if first.get("status") == "skipped" else (
            "n/a" if first.get("status") == "n/a" else "error")
    value = rate(statistics.median(r["batches_per_s"] for r in ok))
    ratios = [r[key] for r in ok if key in r]
    failed = f", {len(runs) - len(ok)} failed" if len(ok) < len(runs) else ""
    if not ratios:
        return value + (f" ({failed[2:]})" if failed else "")
    if len(ratios) == 1:
        return f"{value} ({ratios[0]:.2f}×{failed})"
    return f"{value} ({statistics.median(ratios):.2f}×; {min(ratios):.2f}–{max(ratios):.2f}{failed})"


def table(rows: List[Dict[str, Any]], columns: Sequence[str], key: str = "ratio", head: str = "way",
          row_of: Callable[[Dict[str, Any]], Any] = lambda r: r["way"],
          col_of: Callable[[Dict[str, Any]], Any] = lambda r: r["workload"]) -> List[str]:
    """A markdown table: one line per ``row_of`` value (labelled by its first row's ``label``),
    one column per ``columns`` entry, cells from ``cell``."""
    lines = [f"| {head} | " + " | ".join(str(c) for c in columns) + " |", "| --- |" + " --- |" * len(columns)]
    for value in dict.fromkeys(row_of(r) for r in rows):
        mine = [r for r in rows if row_of(r) == value]
        label = next((r["label"] for r in mine if r.get("label")), str(value))
        cells = [cell([r for r in mine if col_of(r) == c], key) for c in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def notes(rows: List[Dict[str, Any]]) -> List[str]:
    """``- way: why`` for every row that did not run (once each)."""
    found = sorted({f"- {r['way']}: {r['note']}" for r in rows if r.get("status") != "ok" and r.get("note")})
    return [""] + found if found else []


def machine_line(m: Dict[str, Any], date: Optional[str] = None) -> str:
    names = {"tensorflow": "TensorFlow", "keras": "Keras", "jax": "JAX", "torch": "torch", "grain": "Grain",
             "h5py": "h5py", "numpy": "numpy", "kerasfeed": "kerasfeed"}
    libs = ", ".join(f"{name} {m[k]}" for k, name in names.items() if m.get(k))
    return (f"Machine: {m['cpu']}, {m['cores_usable']} usable cores of {m['cores']}, {m['ram_gb']} GB RAM; "
            f"{m['platform']}{'; ' + date if date else ''}. Python {m['python']}, {libs}. "
            f"Large copy: {m['copy_gbs']} GB/s. "
            f"Load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}.")


# --- the drain benchmark's report (benchmarks/run.py) ---------------------------------------------------


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
            cells += [r["way"], rate(r["batches_per_s"]), f"{r['x_serial']:.2f}" if "x_serial" in r else "–",
                      fmt(r["timed_epoch_s"], 3), fmt(r["first_batch_s"], 2), fmt(r["one_off_s"], 2),
                      fmt(r["main_cpu_us_per_batch"]), fmt(r["worker_cpu_us_per_batch"]), mem,
                      f"picked {r['picked']}" if r.get("picked") else r.get("note", "")]
        else:
            cells += [r["way"], r["status"], "", "", "", "", "", "", "", r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return lines


def _processes_table(kp: List[Dict[str, Any]]) -> List[str]:
    out = ["", "#### kerasfeed processes path", "",
           "Consumer CPU = CPU time of the whole main process (tf.data runtime, the executor's consumer side, "
           "the loop) in the timed epoch per batch; the executor's own figure is its consumer-side time per item "
           "as it reports it (all epochs). Worker start-up is the executor's (spawn to ready), first batch is "
           "build + first batch of epoch 1.", "",
           "| workload | batches/s | consumer CPU µs/batch | executor consumer µs/item | worker CPU µs/batch "
           "| worker start-up s | first batch s | workers | RSS per worker MB | USS per worker MB |",
           "|" + " --- |" * 10]
    for r in kp:
        ws = r.get("workers") or []
        st = (r.get("executor") or {}).get("stats") or {}
        st = st if isinstance(st, dict) else {}
        rss = mean([w["rss_mb"] for w in ws]) if ws else st.get("rss_mb_per_worker")
        uss = mean([w["uss_mb"] for w in ws]) if ws else st.get("uss_mb_per_worker")
        out.append(f"| {r['workload']} | {rate(r['batches_per_s'])} | {fmt(r['main_cpu_us_per_batch'])} | "
                   f"{fmt(st.get('consumer_us_per_item'))} | {fmt(r['worker_cpu_us_per_batch'])} | "
                   f"{fmt(st.get('startup_s'), 2)} | {fmt(r['first_batch_s'], 2)} | "
                   f"{len(ws) or st.get('workers', '–')} | {fmt(rss)} | {fmt(uss)} |")
    return out


def _classic(c: Dict[str, Any]) -> List[str]:
    out = ["", "#### 100 slow generators", ""]
    if c.get("status") != "ok":
        return out + [c.get("note", "n/a")]
    fg, kf = c["from_generator"], c["kerasfeed"]
    return out + [f"Each of {c['generators']} generators sleeps {c['sleep_s']} s, then yields one image/mask pair.",
                  "", "| way | seconds for all | note |", "| --- | --- | --- |",
                  f"| `from_generator` over the chained generators | {fg['extrapolated_s']:.2f} | "
                  f"{fg['note']} ({fg['measured_s']:.2f} s measured) |",
                  f"| `{kf['call']}` | {kf['best_s']:.3f} | best of 2 passes |", "",
                  f"Speed-up {c['speedup']:.1f}×; target ≥ 20×: {'met' if c['target']['met'] else 'NOT met'}."]


def to_markdown(res: Dict[str, Any]) -> str:
    """The drain benchmark's tables (``benchmarks/run.py``)."""
    wls, rows, s = res["workloads"], res["rows"], res["settings"]
    out = [f"### Benchmark ({'quick' if s['quick'] else 'full'} run, {res['date']})", "",
           machine_line(res["machine"]), ""]
    if rows or res.get("h5file"):
        rounds = f" {s['rounds']} rounds: median (median ratio; range)." if s.get("rounds", 1) > 1 else ""
        out += ["Batches per epoch: " + ", ".join(f"{w} {s['batches'][w]}" for w in wls)
                + f". Rate = batches / best timed epoch (epoch 2, plus up to {s['max_timed_epochs'] - 1} more "
                  f"while the timed total is under {s['min_timed_s']} s); start-up is in the detail table."
                + rounds, ""]
    if rows:
        out += ["#### Batches/s (× the serial loop)", ""] + table(rows, wls, "x_serial", "way of feeding")
        out += notes(rows)
        auto = [f"- {r['workload']}: **{r.get('picked', '?')}**. {r.get('note', '')}" for r in rows
                if r["way"] == "kerasfeed-auto" and r["status"] == "ok" and r.get("round", 0) == 0]
        if auto:
            out += ["", "What kerasfeed `auto` picked, and why:", ""] + auto
        lat = res.get("latency_line")
        if lat:
            out += ["", f"5 ms latency source (io): kerasfeed threads = {lat['x_serial']:.1f}× the serial loop "
                        f"({rate(lat['batches_per_s'])} batches/s); target ≥ 20×: "
                        f"{'met' if lat['met'] else 'NOT met'}."]
        kp = [r for r in rows if r["way"] == "kerasfeed-processes" and r["status"] == "ok"]
        if kp:
            out += _processes_table(kp)
        out += ["", "#### Details", ""] + _detail_rows(rows)
    h5 = res.get("h5file")
    if h5:
        out += ["", "#### Gzip-chunked scene file", "",
                f"Source: {h5['source']}; {h5['batches']} batches of 8 scenes × 4096 points × 6 float32, "
                "gzip, chunks of 8 scenes.", ""] + _detail_rows(h5["rows"], with_workload=False)
        if h5.get("target"):
            t = h5["target"]
            out += ["", f"kerasfeed processes = {t['x_serial']:.2f}× serial; target ≥ 1.5×: "
                        f"{'met' if t['met'] else 'NOT met'}."]
    if res.get("classic"):
        out += _classic(res["classic"])
    out += ["", f"Whole run: {res['elapsed_s']:.0f} s."]
    return "\n".join(out) + "\n"


def update_readme(path: os.PathLike, markdown: str) -> None:
    """Replaces the block between the benchmark-results markers of ``path`` (each alone on its line)."""
    path = pathlib.Path(path)
    text = path.read_text()
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

    wls, rows = res["workloads"], [r for r in res["rows"] if r["status"] == "ok"]
    names = list(dict.fromkeys(r["way"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 5.6))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        by = {r["workload"]: r for r in rows if r["way"] == name}
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(wls))]
        label = next(r["label"] for r in rows if r["way"] == name).replace("`", "")
        ax.bar(xs, [by[w].get("x_serial", 0) if w in by else 0 for w in wls], width, label=label)
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
