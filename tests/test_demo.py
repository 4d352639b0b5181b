"""The main job: ``python -m kerasfeed demo`` trains three ways, says what ran, and is quiet."""

import os
import re
import subprocess
import sys

import pytest

from kerasfeed.demo import run_demo

# TensorFlow's start-up lines ("I0000 00:00:... port.cc:153] oneDNN custom operations are on", absl's
# "All log messages before absl::InitializeLog()", CPU feature notices) and its log-line format.
TF_NOISE = re.compile(
    r"^[IWEF]\d{4} |oneDNN|absl::InitializeLog|cpu_feature_guard|rebuild TensorFlow|TF_ENABLE_ONEDNN_OPTS", re.M
)


def quiet_env():
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the default a user has
    return env


def test_demo_cli_trains_three_ways_shows_executors_and_prints_no_tensorflow_noise(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kerasfeed", "demo", "--workdir", str(tmp_path), "--epochs", "4"],
        capture_output=True,
        text=True,
        env=quiet_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert list(tmp_path.glob("scenes-*.h5")), "the demo did not write its scene file"
    assert not TF_NOISE.search(proc.stderr + out), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # which executor ran and why
    assert re.search(r"training with fit\(to_dataset\(seq, executor='auto'\)\): (threads|processes).*auto chose", out), out
    rows = {}
    for m in re.finditer(r"^(fit\(.*?\))\s+(keras|threads|processes)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M):
        rows[m.group(1)] = (m.group(2), *[float(v) for v in m.groups()[2:]])
    assert len(rows) == 3, out
    assert {ran_on for ran_on, *_ in rows.values()} == {"keras", "threads", "processes"}, out  # both kerasfeed paths
    for label, (_, loss, acc, val_acc, rate) in rows.items():
        assert val_acc > 0.5, f"{label} held-out accuracy {val_acc} is not clearly above chance (0.25)"
        assert rate > 0


def test_cli_help_is_plain_text_with_choices_and_defaults():
    top = subprocess.run([sys.executable, "-m", "kerasfeed", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "demo" in top.stdout and "profile" in top.stdout
    demo = subprocess.run([sys.executable, "-m", "kerasfeed", "demo", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert demo.returncode == 0
    for text in (top.stdout, demo.stdout):
        assert "``" not in text, text  # no raw reST
    assert re.search(r"--epochs EPOCHS\s+training epochs of each run \(default: 6\)", demo.stdout), demo.stdout
    assert "{auto,threads,processes}" in demo.stdout and "(default: auto)" in demo.stdout, demo.stdout
    bad = subprocess.run([sys.executable, "-m", "kerasfeed", "demo", "--executor", "gpu"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'gpu'" in bad.stderr


def test_demo_arguments_it_cannot_run_with_are_refused_before_tensorflow_starts(tmp_path):
    # Before: --epochs 0 wrote the scenes and trained, then a KeyError: 'loss'; a file as --workdir, a bare
    # FileExistsError.
    (tmp_path / "afile").write_text("")
    for args, message in (
        (["--epochs", "0"], "demo: `epochs` must be a positive int. Received: epochs=0"),
        (["--workdir", str(tmp_path / "afile")], "demo: the work folder is a file, not a folder. Received: workdir="),
        (["--workdir", str(tmp_path / "afile" / "sub")],
         f"demo: '{tmp_path / 'afile'}', on the way to the work folder, is a file, not a folder. Received: workdir="),
    ):
        bad = subprocess.run([sys.executable, "-m", "kerasfeed", "demo", *args], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, KERASFEED_CACHE=str(tmp_path)))
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert "tensorflow" not in bad.stderr.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no scene file written
    with pytest.raises(ValueError, match=r"`num_scenes` must be an int of at least 2.*Received: num_scenes=1"):
        run_demo(str(tmp_path), num_scenes=1)


def test_closing_a_process_executor_right_away_prints_nothing():
    code = (
        "import numpy as np, kerasfeed\n"
        "class S:\n"
        "    def __len__(self): return 4\n"
        "    def __getitem__(self, i): return np.zeros(3)\n"
        "for _ in range(3):\n"
        "    kerasfeed.ProcessExecutor(S(), workers=2).close()\n"
        "ex = kerasfeed.ProcessExecutor(S(), workers=2, worker_init=lambda: __import__('time').sleep(0.3))\n"
        "ex.close()  # while the workers are still starting\n"
        "print('closed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=quiet_env())
    assert proc.returncode == 0 and proc.stdout == "closed\n", proc.stderr
    assert proc.stderr == "", proc.stderr


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "kerasfeed", "nope"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr
