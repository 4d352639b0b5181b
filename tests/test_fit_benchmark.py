"""Smoke test of the fit benchmark's measurements (benchmarks/fit_ways.py, fit.py) on tiny sizes.

Structure, not speed: model.fit runs every batch of every epoch through the
in-memory limit and a kerasfeed dataset, the numpy view iterates kerasfeed's
numpy path and Grain, ratios and the markdown come out of a result.
"""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import fit, fit_ways, workloads  # noqa: E402


@pytest.mark.parametrize("way", ["memory", "kerasfeed-threads"])
def test_fit_view_times_every_epoch_after_the_first(way, tmp_path):
    res = fit_ways.run_fit(way, workloads.make_workload("io", 12, tmp_path), epochs=3, steps_per_execution=5)
    assert res["status"] == "ok" and res["batches"] == 12
    assert len(res["timed_epochs_s"]) == 2 and min(res["timed_epochs_s"]) > 0
    assert res["batches_per_s"] == pytest.approx(12 / min(res["timed_epochs_s"]))
    assert res["main_cpu_us_per_batch"] > 0


@pytest.mark.parametrize("way", ["kerasfeed-threads", "grain-threads"])
def test_numpy_view_iterates_whole_passes(way, tmp_path):
    res = fit_ways.run_numpy(way, workloads.make_workload("io", 10, tmp_path), epochs=2)
    assert res["status"] == "ok" and res["batches"] == 10 and len(res["timed_epochs_s"]) == 1


def test_ratios_and_markdown_from_rows():
    rows = [
        {"view": "fit", "way": "memory", "workload": "io", "status": "ok", "batches_per_s": 800.0},
        {"view": "fit", "way": "kerasfeed-threads", "workload": "io", "status": "ok", "batches_per_s": 640.0},
        {"view": "fit", "way": "torch", "workload": "io", "status": "n/a", "note": fit_ways.TORCH_FIT_NA},
    ]
    fit._ratios(rows)
    assert rows[1]["ratio"] == pytest.approx(0.8)
    res = {"machine": fit.machine_info(), "date": "d", "loadavg_end": [0, 0, 0], "rows": rows,
           "settings": {"quick": True, "batches": {"io": 8}, "timed_epochs": 1, "steps_per_execution": 1,
                        "workloads": ["io"], "views": ["fit"]}}
    md = fit.to_markdown(res)
    assert "| kerasfeed `to_dataset`, threads | 640 (0.80) |" in md
    assert "| PyTorch `DataLoader` | n/a |" in md and "does not accept a torch DataLoader" in md


def test_rounds_take_each_ratio_against_the_reference_of_their_own_round():
    rates = {0: (1000.0, 900.0), 1: (1600.0, 1200.0), 2: (1200.0, 1020.0)}  # (memory, kerasfeed) per round
    rows = [{"view": "fit", "way": way, "workload": "io", "status": "ok", "batches_per_s": rate, "round": k}
            for k, pair in rates.items() for way, rate in zip(("memory", "kerasfeed-threads"), pair)]
    rows.append({"view": "fit", "way": "kerasfeed-auto", "workload": "io", "status": "error", "note": "x", "round": 0})
    fit._ratios(rows)
    assert [r["ratio"] for r in rows if r["way"] == "kerasfeed-threads"] == pytest.approx([0.9, 0.75, 0.85])
    res = {"machine": fit.machine_info(), "date": "d", "loadavg_end": [0, 0, 0], "rows": rows,
           "settings": {"quick": True, "batches": {"io": 8}, "timed_epochs": 1, "steps_per_execution": 1,
                        "rounds": 3, "workloads": ["io"], "views": ["fit"]}}
    md = fit.to_markdown(res)
    assert "| kerasfeed `to_dataset`, threads | 1020 (0.85; 0.75–0.90) |" in md  # median rate, median ratio, range
    assert "| kerasfeed `to_dataset`, auto | error |" in md and "3 rounds" in md
    with pytest.raises(ValueError, match="rounds"):
        fit.run_fit_benchmark(rounds=0, output_dir=None)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="Unknown workload 'gpu'"):
        fit.run_fit_benchmark(workloads_=["gpu"], output_dir=None)
    with pytest.raises(ValueError, match="Unknown way 'tf-magic'"):
        fit.run_fit_benchmark(only=["tf-magic"], output_dir=None)
    with pytest.raises(ValueError, match="at least 2"):
        fit.run_fit_benchmark(epochs=1, output_dir=None)


def test_paced_cost_splits_the_input_path_cpu_by_thread(tmp_path):
    from benchmarks import paced_cost

    # More batches than the pool makes ahead during the warm-up, so its threads work while timed.
    res = paced_cost.run("io", rate=1000, batches=200, warmup=10, ways=["memory", "kerasfeed-threads"],
                         cache_dir=str(tmp_path))
    memory, threads = res["runs"]
    assert memory["status"] == threads["status"] == "ok", res["runs"]
    assert memory["cpu_us_per_batch"]["kerasfeed threads"] == 0  # no kerasfeed pool behind the in-memory path
    assert threads["cpu_us_per_batch"]["kerasfeed threads"] > 0  # the pool's threads are counted as such
    assert threads["total_us_per_batch"] == pytest.approx(sum(threads["cpu_us_per_batch"].values()))
    assert "| kerasfeed-threads |" in res["markdown"]
    with pytest.raises(ValueError, match="Unknown way 'tf-magic'"):
        paced_cost.run("io", ways=["tf-magic"])
    with pytest.raises(ValueError, match="Received: rate=0"):
        paced_cost.run("io", rate=0)
