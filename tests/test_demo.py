"""The main job: ``python -m kerasfeed demo`` trains both ways and learns."""

import os
import re
import subprocess
import sys


def test_demo_cli_trains_both_ways_above_chance(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "kerasfeed", "demo", "--workdir", str(tmp_path), "--epochs", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert list(tmp_path.glob("scenes-*.h5")), "the demo did not write its scene file"
    rows = {}
    for label in ("fit(seq)", "fit(to_dataset(seq))"):
        m = re.search(re.escape(label) + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out)
        assert m, out
        rows[label] = [float(v) for v in m.groups()]
    for label, (loss, acc, val_acc, rate) in rows.items():
        assert val_acc > 0.5, f"{label} held-out accuracy {val_acc} is not clearly above chance (0.25)"
        assert rate > 0


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "kerasfeed", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
