"""Every ```python block of README.md and docs/*.md runs as written.

Convention for writers of README.md and docs/*.md
-------------------------------------------------
- Every fenced block opened with ```python is run; other languages (bash,
  text) are not. The blocks of one file run in order in one fresh Python
  process (a reader follows along: a later block may use names an earlier one
  defined), with a fresh temporary directory as the working directory, so
  relative paths such as ``"scenes.h5"`` or ``"run/state.json"`` are local.
- Names a block assumes but does not define come from fixtures, named in an
  HTML comment on the line(s) just before the block (invisible on GitHub):

      <!-- test: setup=scenes_h5,model -->

  Fixtures (``FIXTURES`` below) run before the block, in its namespace, each
  at most once per file; a fixture's own needs run first:

  - ``scenes_h5``: a small ``scenes.h5`` (``make_synthetic_scenes``: 64
    scenes x 64 points x 6 features, 4 classes; keys ``points``, ``labels``).
  - ``scene_parts``: ``part0.h5`` and ``part1.h5`` (32 scenes each).
  - ``model``: ``model``, a compiled Keras classifier of point clouds
    ``(batch, points, 6)`` -> 4 classes (sparse labels); any point count.
  - ``seq``: ``seq``, a ``kerasfeed.SceneSequence`` of 8 batches of
    ``(points, labels)`` from ``scenes.h5``.
  - ``streams``: ``my_generator(k)`` (yields a few ``(x, y)`` samples),
    ``paths`` + ``read_jsonl(path)`` (three JSON-lines files), ``producer(put)``
    (two epochs with ``END_OF_EPOCH``), all samples ``(float32[6], int64)``.
  - ``resume_state``: ``run/data_state.json`` holding ``{"epoch": 1,
    "batches": 3}``, as an interrupted run leaves it.
  - ``tf``: ``import tensorflow as tf``.
- Other keys of the comment: ``fresh`` starts a new process for this block
  (and the ones after it), ``env=NAME=VALUE`` (with ``fresh``) sets an
  environment variable for that process (e.g. ``KERAS_BACKEND=jax``), and
  ``skip="reason"`` skips a block that cannot run here (several hosts, a
  GPU). A skip needs a reason; skipped blocks show in pytest's warnings summary.
- Keras warnings are errors in these runs: documented ``fit`` calls must not
  make Keras warn (``shuffle=True ... ignored``, ``ran out of data``).
- Keep data tiny: the whole test should take well under a minute.
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIXTURES = {
    "tf": ([], "import tensorflow as tf\n"),
    "scenes_h5": ([], """
        from kerasfeed.datasets import make_synthetic_scenes
        make_synthetic_scenes("scenes.h5", num_scenes=64, points_per_scene=64, seed=0)
    """),
    "scene_parts": ([], """
        from kerasfeed.datasets import make_synthetic_scenes
        make_synthetic_scenes("part0.h5", num_scenes=32, points_per_scene=64, seed=0)
        make_synthetic_scenes("part1.h5", num_scenes=32, points_per_scene=64, seed=1)
    """),
    "model": ([], """
        import keras
        keras.utils.set_random_seed(0)
        _inputs = keras.Input((None, 6))
        _h = keras.layers.Dense(16, activation="relu")(_inputs)
        _h = keras.layers.GlobalMaxPooling1D()(_h)
        model = keras.Model(_inputs, keras.layers.Dense(4, activation="softmax")(_h))
        model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    """),
    "seq": (["scenes_h5"], """
        import h5py
        import kerasfeed

        class _FixtureScenes(kerasfeed.SceneSequence):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                with h5py.File("scenes.h5", "r") as f:
                    return f["points"][8 * i : 8 * i + 8], f["labels"][8 * i : 8 * i + 8]

        seq = _FixtureScenes()
    """),
    "streams": ([], """
        import json
        import numpy as np
        import kerasfeed

        def my_generator(k):
            rng = np.random.default_rng(k)
            for _ in range(3):
                yield rng.random(6, dtype=np.float32), np.int64(k % 4)

        paths = []
        for _k in range(3):
            with open(f"part{_k}.jsonl", "w") as _f:
                for _j in range(5):
                    _f.write(json.dumps({"x": [float(_j)] * 6, "y": _k}) + "\\n")
            paths.append(f"part{_k}.jsonl")

        def read_jsonl(path):
            with open(path) as f:
                for line in f:
                    row = json.loads(line)
                    yield np.float32(row["x"]), np.int64(row["y"])

        def producer(put):
            for epoch in range(2):
                for j in range(10):
                    put((np.full(6, j, np.float32), np.int64(j % 4)))
                put(kerasfeed.END_OF_EPOCH)
    """),
    "resume_state": ([], """
        import json, os
        os.makedirs("run", exist_ok=True)
        with open("run/data_state.json", "w") as _f:
            json.dump({"epoch": 1, "batches": 3}, _f)
    """),
}

PRELUDE = """
import os, sys, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("error", module=r"keras(\\.|$)")  # documented paths never make Keras warn
__blocks__ = {}
"""

_COMMENT = re.compile(r"<!--\s*test:(?P<body>.*?)-->", re.S)
_FENCE = re.compile(r"^```(\S*)\s*$")


class Block:
    def __init__(self, path, line, code, options):
        self.path, self.line, self.code, self.options = path, line, code, options

    @property
    def where(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_options(body, where):
    options = {"setup": [], "skip": None, "fresh": False, "env": {}}
    for token in shlex.split(body):
        key, _, value = token.partition("=")
        if key == "setup":
            options["setup"] += [v for v in value.split(",") if v]
        elif key == "skip":
            options["skip"] = value
        elif key == "fresh":
            options["fresh"] = True
        elif key == "env":
            name, _, val = value.partition("=")
            options["env"][name] = val
        else:
            raise AssertionError(f"{where}: unknown key {key!r} in a test comment. Received: {body!r}")
    unknown = [f for f in options["setup"] if f not in FIXTURES]
    assert not unknown, f"{where}: unknown fixture(s) {unknown}; known: {sorted(FIXTURES)}"
    assert options["skip"] is None or options["skip"].strip(), f"{where}: `skip` needs a reason"
    assert not options["env"] or options["fresh"], f"{where}: `env=` needs `fresh` (a new process)"
    return options


def extract_blocks(path):
    """The ```python blocks of a Markdown file with their test options."""
    lines = path.read_text().splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            start, lang = i, fence.group(1)
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if lang == "python":
                where = f"{path.relative_to(ROOT)}:{start + 1}"
                body = pending or ""
                blocks.append(Block(path, start + 1, "\n".join(lines[start + 1 : i]) + "\n", parse_options(body, where)))
            pending = None
        else:
            # A comment counts for the next block when only blank lines follow it.
            text = lines[i]
            if "<!--" in text and "test:" in text:
                j = i
                while "-->" not in lines[j] and j + 1 < len(lines):
                    j += 1
                m = _COMMENT.search("\n".join(lines[i : j + 1]))
                pending = m.group("body") if m else pending
                i = j
            elif text.strip():
                pending = None
        i += 1
    return blocks


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def build_runs(blocks):
    """Groups blocks into scripts (a new one at every `fresh` block)."""
    runs, current = [], None
    for b in blocks:
        if current is None or b.options["fresh"]:
            current = {"env": dict(b.options["env"]), "parts": [PRELUDE], "done": set(), "blocks": []}
            runs.append(current)
        if b.options["skip"] is not None:
            continue
        for name in b.options["setup"]:
            add_fixture(current, name)
        current["blocks"].append(b)
        current["parts"].append(
            f"print('--- running {b.where}', file=sys.stderr, flush=True)\n"
            f"exec(compile({b.code!r}, {b.where!r}, 'exec'), globals())\n"
        )
    return [r for r in runs if r["blocks"]]


def add_fixture(run, name):
    if name in run["done"]:
        return
    needs, code = FIXTURES[name]
    for need in needs:
        add_fixture(run, need)
    run["done"].add(name)
    run["parts"].append(textwrap.dedent(code))


def run_file(path, tmp_path):
    blocks = extract_blocks(path)
    skipped = [f"{b.where}: {b.options['skip']}" for b in blocks if b.options["skip"] is not None]
    for line in skipped:  # visible in pytest's warnings summary: nothing is skipped silently
        warnings.warn(f"code block not run: {line}", UserWarning, stacklevel=1)
    for k, run in enumerate(build_runs(blocks)):
        workdir = tmp_path / f"run{k}"
        workdir.mkdir()
        script = workdir / "_blocks.py"
        script.write_text("\n".join(run["parts"]))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.update(run["env"])
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
        )
        running = re.findall(r"--- running (\S+)", proc.stderr)
        assert proc.returncode == 0, (
            f"a code block of {path.name} failed ({running[-1] if running else 'fixtures'}):\n{proc.stderr[-4000:]}"
        )
        assert running == [b.where for b in run["blocks"]], running
    return blocks


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_markdown_python_blocks_run_as_written(path, tmp_path):
    blocks = run_file(path, tmp_path)
    if path.name == "README.md":
        assert len(blocks) >= 3, "README.md lost its code blocks?"


def test_the_block_extractor_reads_options_and_refuses_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n<!-- test: setup=model,seq -->\n\n```python\nprint(1)\n```\n"
        "```bash\nls\n```\n<!-- test: skip=\"needs two hosts\" -->\n```python\nboom()\n```\n"
        "<!-- test: setup=model -->\nnot the block's\n```python\nx = 1\n```\n"
    )
    blocks = extract_blocks(doc)
    assert [(b.line, b.options["setup"], b.options["skip"]) for b in blocks] == [
        (4, ["model", "seq"], None), (11, [], "needs two hosts"), (16, [], None)]
    runs = build_runs(blocks)
    assert [b.line for b in runs[0]["blocks"]] == [4, 16]
    assert "_FixtureScenes" in "".join(runs[0]["parts"]) and "scenes.h5" in "".join(runs[0]["parts"])
    doc.write_text("<!-- test: setup=nope -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="unknown fixture"):
        extract_blocks(doc)
    doc.write_text("<!-- test: skip= -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"):
        extract_blocks(doc)
