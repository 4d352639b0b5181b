"""The profiler's chart (matplotlib, imported only here)."""

from __future__ import annotations

from typing import Any, Optional


def plot_report(report: Any, path: Optional[str] = None):
    """Two panels: items/s against count per executor (the serial loop as a
    line), and the per-worker timeline of the recommended run's timed pass.

    Returns the ``matplotlib.figure.Figure``; saves it to ``path`` if given.
    """
    import matplotlib

    if path is not None and matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"threads": "tab:blue", "processes": "tab:orange"}
    for name in ("threads", "processes"):
        runs = sorted((r for r in report.runs if r["executor"] == name), key=lambda r: r["count"])
        if runs:
            ax_rate.plot([r["count"] for r in runs], [r["items_per_s"] / report.batch_size for r in runs],
                         marker="o", color=colors[name], label=name)
    ax_rate.axhline(report.serial_items_per_s / report.batch_size, color="gray", linestyle="--", label="serial loop")
    ax_rate.plot([report.workers], [report.batches_per_s], marker="*", markersize=16, color="tab:red",
                 linestyle="none", label=f"recommended: {report.executor} x{report.workers}")
    ax_rate.set_xscale("log", base=2)
    counts = sorted({r["count"] for r in report.runs})
    ax_rate.set_xticks(counts, [str(c) for c in counts])
    ax_rate.minorticks_off()
    ax_rate.set_xlabel("threads in flight / worker processes")
    ax_rate.set_ylabel("batches/s" if report.batch_size > 1 else "items/s")
    ax_rate.set_title(f"{report.source}: {report.category}")
    ax_rate.legend(fontsize=8)

    chosen = next((r for r in report.runs if (r["executor"], r["count"]) == (report.executor, report.workers)), None)
    timeline = chosen["timeline"] if chosen else []
    if timeline:
        lanes = sorted({lane for lane, _, _ in timeline})
        row = {lane: k for k, lane in enumerate(lanes)}
        for lane, start, end in timeline:
            ax_time.broken_barh([(start * 1e3, max(end - start, 1e-6) * 1e3)], (row[lane] - 0.4, 0.8),
                                color=colors.get(report.executor, "tab:gray"), edgecolor="white", linewidth=0.3)
        ax_time.set_yticks(range(len(lanes)))
        ax_time.set_yticklabels([f"{'thread' if report.executor == 'threads' else 'worker'} {lane}" for lane in lanes],
                                fontsize=7 if len(lanes) > 16 else 9)
    else:
        ax_time.text(0.5, 0.5, "no per-item timeline for this run", ha="center", va="center",
                     transform=ax_time.transAxes)
    ax_time.set_xlabel("ms since the pass started")
    ax_time.set_title(f"one pass, {report.executor} x{report.workers}: each bar is one item being made")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


__all__ = ["plot_report"]
