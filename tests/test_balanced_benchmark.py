"""benchmarks/balanced.py runs on tiny settings and reports what it should."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_balanced_benchmark_tiny(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "balanced.py"), "--tiny", "--workdir", str(tmp_path),
         "--methods", "rejection_resample,kerasfeed"],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(tmp_path.glob("part-*.tfrecord"))) == 4
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["method"] == ["first batch s", "records read per record delivered", "peak RSS MB", "batches/s", "rare share"]
    # rejection reads ~25 records per record it keeps at 1:50; kerasfeed reads what it delivers
    # (plus the few probed and made ahead)
    assert float(rows["rejection_resample"][1]) > 10
    assert 1.0 <= float(rows["kerasfeed"][1]) < 1.5
    assert abs(float(rows["kerasfeed"][4]) - 0.5) < 0.05
