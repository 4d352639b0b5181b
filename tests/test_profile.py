"""The profiler: classification and recommendation on known sources, the table, the chart and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution.auto import Probe, decide
from kerasfeed.observe.profile import CATEGORIES, _cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Sleeping:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.004)
        return np.full((4,), i, np.float32)


class PurePython:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        total = 0
        for k in range(20000):
            total += k * k % 7
        return np.full((4,), total, np.float32)


class LargeArrays:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return np.full((8, 256, 256, 3), i, np.float32)  # 6 MB


LEAN = {"items": 10, "workers": (2,), "threads": (4,)}


@pytest.mark.parametrize(
    "source, category, executor",
    [(Sleeping(), "waiting", "threads"), (PurePython(), "GIL-bound", "processes"), (LargeArrays(), "transport-bound", None)],
    ids=["sleeping", "pure-python", "large-array"],
)
def test_profile_classifies_and_recommends(source, category, executor):
    report = kerasfeed.profile(source, **LEAN)
    assert report.category == category, report.evidence
    # What executor="auto" chooses on the same probe (large items: its prediction of both, which the
    # machine's load can tip; a rule of profile's own recommended processes where auto chose threads).
    expected = decide(Probe(**report.probe), 2, _cpus())
    assert report.executor == expected[0] and report.reason.startswith(expected[1]), (report.reason, expected)
    executor = executor or expected[0]
    assert report.executor == executor, report.reason
    assert report.workers in (2, 4)
    assert {(r["executor"], r["count"]) for r in report.runs} == {("threads", 4), ("processes", 2)}
    assert report.items_per_s > 0 and report.batches_per_s == report.items_per_s
    table = report.table()
    assert category in table and f"executor={executor!r}" in table and "serial" in table
    json.dumps(report.as_dict(), default=str)


def test_the_recommendation_is_auto_s_choice_for_large_items_too():
    # 19 MB items that mostly wait and copy cheaply: auto predicts threads; profile had a rule of its
    # own (items >= 4 MB: processes) and recommended processes where auto chose threads.
    from kerasfeed.observe.profile import _recommend

    probe = Probe(wall_s=0.01, cpu_s=0.005, runqueue_s=0.0, nbytes=19 * 2**20, copy_s=0.001,
                  parallelism_2_threads=1.9, calls=10)
    runs = [dict(executor="threads", count=4, items_per_s=280.0), dict(executor="processes", count=2, items_per_s=180.0)]
    name, count, rate, reason = _recommend(probe, runs, 2)
    assert (name, count, rate) == ("threads", 4, 280.0)
    assert reason == decide(probe, 2, 2)[1]


def test_the_reason_predicts_the_worker_count_recommended():
    """2 and 4 workers timed alike on 2 CPUs: "workers=2" was recommended, "because 4 workers predicted at ..."."""
    from kerasfeed.observe.profile import _recommend

    probe = Probe(wall_s=0.01, cpu_s=0.01, runqueue_s=0.0, nbytes=100, copy_s=1e-6, parallelism_2_threads=1.0,
                  calls=10)
    runs = [dict(executor="threads", count=4, items_per_s=100.0), dict(executor="processes", count=2, items_per_s=195.0),
            dict(executor="processes", count=4, items_per_s=200.0)]
    name, count, rate, reason = _recommend(probe, runs, 2)
    assert (name, count) == ("processes", 2) and reason == decide(probe, 2, 2)[1] and "2 workers predicted" in reason


def test_a_recommendation_of_one_worker_says_why_beside_auto_s_prediction_for_two():
    """1 and 2 workers timed alike: "workers=1" came with "2 workers predicted at ..." and nothing more."""
    from kerasfeed.observe.profile import _recommend

    probe = Probe(wall_s=0.01, cpu_s=0.01, runqueue_s=0.0, nbytes=100, copy_s=1e-6, parallelism_2_threads=1.0,
                  calls=10)
    runs = [dict(executor="threads", count=4, items_per_s=100.0), dict(executor="processes", count=1, items_per_s=190.0),
            dict(executor="processes", count=2, items_per_s=200.0)]
    name, count, rate, reason = _recommend(probe, runs, 2)
    assert (name, count) == ("processes", 1)
    assert reason.startswith(decide(probe, 2, 2)[1]) and "1 worker made 190 items/s, within 0.9 of the best (200 with 2)" in reason


def test_a_recommendation_auto_s_choice_was_not_measured_for_says_so():
    """Auto would choose processes (GIL-bound items), but only threads were measured (threads=[] asked for,
    or the source cannot be pickled): the measured one is named as such, not as auto's choice."""
    from kerasfeed.observe.profile import _recommend

    probe = Probe(wall_s=0.01, cpu_s=0.01, runqueue_s=0.0, nbytes=100, copy_s=1e-6, parallelism_2_threads=1.0,
                  calls=10)
    assert decide(probe, 2, 2)[0] == "processes"
    name, count, rate, reason = _recommend(probe, [dict(executor="threads", count=1, items_per_s=90.0)], 2)
    assert (name, count, rate) == ("threads", 1, 90.0)
    assert reason.startswith("the faster of the executors measured; executor='auto' would choose processes here ("), reason
    assert reason.endswith("but no processes run was made (not asked for, or not possible: see skipped)"), reason


def test_profile_figures_and_chart(tmp_path):
    path = tmp_path / "chart.png"
    report = kerasfeed.profile(Sleeping(), batch_size=4, chart=str(path), **LEAN)
    assert path.stat().st_size > 10_000
    assert report.category in CATEGORIES
    assert "% on the CPU" in report.evidence
    assert report.batches_per_s == pytest.approx(report.items_per_s / 4)
    threads = next(r for r in report.runs if r["executor"] == "threads")
    # The timeline of the thread run: one bar per item, on at most 4 lanes, inside the pass.
    assert len(threads["timeline"]) == 10
    assert {lane for lane, _, _ in threads["timeline"]} <= {0, 1, 2, 3}
    assert all(0 <= s < e <= threads["seconds"] + 1e-3 for _, s, e in threads["timeline"])
    processes = next(r for r in report.runs if r["executor"] == "processes")
    assert processes["startup_s"] > 0
    # Worker processes time their own items: one bar per item, on the 2 workers' lanes.
    assert len(processes["timeline"]) == 10
    assert {lane for lane, _, _ in processes["timeline"]} <= {0, 1}


def test_profile_rejects_bad_arguments():
    with pytest.raises(ValueError, match="items.*Received: items=0"):
        kerasfeed.profile(Sleeping(), items=0)
    with pytest.raises(TypeError):
        kerasfeed.profile(object())
    with pytest.raises(TypeError, match=r"profile: `threads` must be a sequence of ints .*Received: threads=2.5$"):
        kerasfeed.profile(Sleeping(), threads=2.5)  # a bare "'float' object is not iterable"


def test_one_int_is_one_count():
    # workers=2 was a bare "'int' object is not iterable".
    report = kerasfeed.profile(Sleeping(), items=4, workers=2, threads=np.int64(4))
    assert {(r["executor"], r["count"]) for r in report.runs} == {("threads", 4), ("processes", 2)}


class Counted:
    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.calls += 1
        return np.zeros(2, np.float32)


def test_a_chart_that_cannot_be_saved_or_nothing_to_time_is_refused_before_timing(tmp_path):
    src = Counted()
    with pytest.raises(ValueError, match=r"folder of `chart` does not exist: .*Received: chart='.*/nope/c.png'"):
        kerasfeed.profile(src, chart=str(tmp_path / "nope" / "c.png"))
    with pytest.raises(ValueError, match=r"cannot save a chart as 'txt'; use one of \[.*'png'.*Received: chart="):
        kerasfeed.profile(src, chart=str(tmp_path / "c.txt"))
    with pytest.raises(ValueError, match=r"`workers` and `threads` are both empty.*Received: workers=\[\], threads=\[\]"):
        kerasfeed.profile(src, workers=[], threads=[])
    assert src.calls == 0  # refused before the source was timed (before: after every run, or StopIteration)
    report = kerasfeed.profile(src, workers=[], threads=[2], chart=str(tmp_path / "c.svg"))
    assert report.executor == "threads" and (tmp_path / "c.svg").stat().st_size > 0


class FailsAt2:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 2:
            raise KeyError(f"no item {i}")
        return np.zeros(2, np.float32)


class Unpicklable(Counted):
    def __init__(self):
        super().__init__()
        self.lock = __import__("threading").Lock()


def test_an_item_that_raises_or_nothing_timeable_gets_a_clear_error():
    # The documented ItemError, naming the index (a bare KeyError before; executor="auto" too).
    with pytest.raises(kerasfeed.ItemError, match=r"FailsAt2\[2\] raised KeyError: 'no item 2'"):
        kerasfeed.profile(FailsAt2(), items=4, workers=[1], threads=[1])
    with pytest.raises(kerasfeed.ItemError, match=r"FailsAt2\[2\] raised KeyError"):
        kerasfeed.to_loader(FailsAt2(), executor="auto")
    # Only processes asked for, and the source cannot go to them: a StopIteration after the timing before.
    with pytest.raises(ValueError, match=r"^profile: nothing could be timed: processes: .*Received: threads=\[\]"):
        kerasfeed.profile(Unpicklable(), items=4, workers=[1], threads=[])


def test_command_line(tmp_path):
    (tmp_path / "my_source.py").write_text(textwrap.dedent(
        """
        import time
        import numpy as np

        class Waits:
            def __len__(self):
                return 32

            def __getitem__(self, i):
                time.sleep(0.003)
                return np.zeros(4, np.float32)

        def make():
            return Waits()
        """
    ))
    env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "kerasfeed", "profile", "my_source:make", "--items", "8", "--workers", "2",
           "--threads", "4", "--chart", "out.png"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "waiting" in done.stdout and "recommend: executor='threads'" in done.stdout
    assert (tmp_path / "out.png").exists()
    # MODULE as a .py file, run from elsewhere: worker processes get its source by value (they failed with
    # "No module named '_kerasfeed_profile_target'", the name it was loaded under).
    by_path = [sys.executable, "-m", "kerasfeed", "profile", f"{tmp_path / 'my_source.py'}:make", "--items", "4",
               "--workers", "1", "--threads", "2", "--chart", "", "--json"]
    done = subprocess.run(by_path, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {run["executor"] for run in json.loads(done.stdout)["runs"]} == {"processes", "threads"}
    bad = subprocess.run([sys.executable, "-m", "kerasfeed", "profile", "nocolon"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MODULE:FACTORY" in bad.stderr and "Received: 'nocolon'" in bad.stderr


class _Delayed:
    def __init__(self, delay: float):
        self.delay = delay

    def __len__(self):
        return 100

    def __getitem__(self, i):
        time.sleep(self.delay)
        return np.full((4,), i, np.float32)


def test_slow_items_are_timed_fewer_by_default_and_items_is_kept_when_given():
    # The default was 64 items whatever they cost: 0.1 s items took 20 s for one thread run and one worker run,
    # 2 s items several minutes (the docs say the profile takes seconds).
    report = kerasfeed.profile(_Delayed(0.25), threads=[4], workers=[])
    assert 4 <= report.items <= 10, report.items  # a serial pass of ~2 s by the probe, at least 4
    assert kerasfeed.profile(_Delayed(0.001), items=6, threads=[1], workers=[]).items == 6
    assert kerasfeed.profile(_Delayed(0.0), threads=[1], workers=[]).items == 64
