"""Smoke test of the fit benchmark (benchmarks/fit.py over runner.measure_fit), costs.py paced and place, tiny sizes.

Structure, not speed: model.fit runs every batch of every epoch through the
in-memory limit and a kerasfeed dataset, the numpy view iterates kerasfeed's
loader, ratios and the markdown come out of a result.
"""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import fit, runner, ways, workloads  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402


@pytest.mark.parametrize("way", ["memory", "kerasfeed-threads"])
def test_fit_view_times_every_epoch_after_the_first(way, tmp_path):
    row = runner.measure_fit(ways.REGISTRY[way], lambda: workloads.make_workload("io", 12, tmp_path),
                             ways.Context("fit", "tensorflow"), epochs=3, steps_per_execution=5,
                             progress=lambda _: None)
    assert row["status"] == "ok" and row["batches"] == 12, row.get("note")
    assert len(row["timed_epochs_s"]) == 2 and min(row["timed_epochs_s"]) > 0
    assert row["batches_per_s"] == pytest.approx(12 / min(row["timed_epochs_s"]))
    assert row["main_cpu_us_per_batch"] > 0


def test_markdown_of_both_views_from_rows():
    rows = [
        {"view": "fit", "way": "memory", "label": "in memory", "workload": "io", "status": "ok",
         "batches_per_s": 800.0, "ratio": 1.0},
        {"view": "fit", "way": "kerasfeed-threads", "label": "kerasfeed `to_dataset`, threads", "workload": "io",
         "status": "ok", "batches_per_s": 640.0, "ratio": 0.8},
        {"view": "fit", "way": "torch", "label": "PyTorch `DataLoader`", "workload": "io", "status": "n/a",
         "note": "n/a (Keras fit on the TensorFlow backend does not accept a torch DataLoader)"},
        {"view": "numpy", "way": "grain-threads", "label": "Grain", "workload": "io", "status": "skipped",
         "note": "skipped: grain not installed"},
    ]
    res = {"machine": machine_info(), "date": "d", "rows": rows,
           "settings": {"quick": True, "batches": {"io": 8}, "timed_epochs": 1, "steps_per_execution": 1,
                        "workloads": ["io"], "views": ["fit", "numpy"]}}
    md = fit.to_markdown(res)
    assert "| kerasfeed `to_dataset`, threads | 640 (0.80×) |" in md
    assert "| PyTorch `DataLoader` | n/a |" in md and "does not accept a torch DataLoader" in md
    assert "| Grain | skipped: grain not installed |" in md


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="Unknown workload 'gpu'"):
        fit.run_fit_benchmark(workloads_=["gpu"], output_dir=None)
    with pytest.raises(ValueError, match="Unknown way 'tf-magic'"):
        fit.run_fit_benchmark(only=["tf-magic"], output_dir=None)
    with pytest.raises(ValueError, match="at least 2"):
        fit.run_fit_benchmark(epochs=1, output_dir=None)
    with pytest.raises(ValueError, match="rounds"):
        fit.run_fit_benchmark(rounds=0, output_dir=None)


def test_paced_cost_splits_the_input_path_cpu_by_thread(tmp_path):
    from benchmarks import costs

    # More batches than the pool makes ahead during the warm-up, so its threads work while timed.
    res = costs.paced("io", rate=1000, batches=200, warmup=10, names=["memory", "kerasfeed-threads"],
                      cache_dir=str(tmp_path))
    memory, threads = res["runs"]
    assert memory["status"] == threads["status"] == "ok", res["runs"]
    assert memory["cpu_us_per_batch"]["kerasfeed threads"] == 0  # no kerasfeed pool behind the in-memory path
    assert threads["cpu_us_per_batch"]["kerasfeed threads"] > 0  # the pool's threads are counted as such
    assert threads["total_us_per_batch"] == pytest.approx(sum(threads["cpu_us_per_batch"].values()))
    assert "| kerasfeed-threads |" in res["markdown"]
    with pytest.raises(ValueError, match="Unknown way 'tf-magic'"):
        costs.paced("io", names=["tf-magic"])
    with pytest.raises(ValueError, match="Received: rate=0"):
        costs.paced("io", rate=0)


def test_place_times_device_put_from_the_heap_and_from_lent_shared_memory():
    from benchmarks import costs

    res = costs.place(repeats=3, shape=(4, 8, 8, 3))
    assert res["device"]["bytes"] == 4 * 8 * 8 * 3
    for name in ("heap", "shared memory (lent)"):
        r = res[name]
        assert 0 < r["wall_us_min"] <= r["wall_us"] <= r["wall_us_max"] and r["cpu_us"] >= 0, (name, r)
