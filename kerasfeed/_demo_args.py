"""The demo's arguments, checked before TensorFlow is imported (``python -m kerasfeed demo``).

Kept apart from ``kerasfeed.demo``, which imports Keras (and so TensorFlow)
when it defines its ``SceneSequence``: the CLI refuses a bad argument at once
and imports TensorFlow only afterwards, with its start-up lines filtered.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from kerasfeed import _validation as _v


def check_demo_arguments(workdir: Optional[str], *, epochs: int, executor: str, num_scenes: int = 640,
                         num_points: int = 512, batch_size: int = 16) -> str:
    """The demo's folder (``workdir`` or the cache); ValueError for an argument the
    demo cannot run with, before TensorFlow is imported or a scene is written."""
    if executor not in ("auto", "threads", "processes"):
        raise ValueError(f"`executor` must be 'auto', 'threads' or 'processes'. Received: executor={executor!r}")
    for name, value in (("epochs", epochs), ("num_points", num_points), ("batch_size", batch_size)):
        _v.positive_int(name, value, owner="demo")
    if not isinstance(num_scenes, int) or isinstance(num_scenes, bool) or num_scenes < 2:
        raise ValueError(
            "demo: `num_scenes` must be an int of at least 2 (a fifth, at least one, is held out). "
            f"Received: num_scenes={num_scenes!r}"
        )
    if workdir is None:
        workdir = os.environ.get("KERASFEED_CACHE") or os.path.join(tempfile.gettempdir(), "kerasfeed-demo")
    found = _v.nearest_existing(workdir)  # the folder itself, or where making it would start
    if not os.path.isdir(found):
        what = ("the work folder is" if found == os.path.abspath(workdir)
                else f"'{found}', on the way to the work folder, is")
        raise ValueError(f"demo: {what} a file, not a folder. Received: workdir={workdir!r}")
    return workdir


__all__ = ["check_demo_arguments"]
