"""A worker that loads a framework anyway says what pulled it in, what it cost, and what to do.

Part of NOTE [ Light framework stand-ins in workers ] (``light_modules.py``):
``light_modules._Finder`` wraps the loader of every real framework import in a
worker with ``TimedLoader``; the outermost one (``keras`` importing
``tensorflow`` is one load) is timed and worker 0 logs one warning per
framework. The worker's stderr is the owner's (scripts, terminals, pytest's
capture); a notebook shows it in the server's log.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, Optional

from kerasfeed.execution import worker_info

logger = logging.getLogger("kerasfeed")

WATCHED = ("tensorflow", "keras", "jax", "torch")  # the frameworks a worker times and warns about
_HERE = os.path.dirname(os.path.abspath(__file__))  # the worker's own machinery
_SKIP_NAMES = ("importlib", "cloudpickle", "pickle.py")

_state = threading.local()
_reported: set = set()
_unpickling = [False]
_starting = [False]  # in worker_init
_stand_ins_off = [False]  # the last unpickling had no stand-ins: the advice says so


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """While the worker runs ``worker_init``: a framework loaded there is paid at start-up, as in unpickling."""
    _starting[0] = True
    try:
        yield
    finally:
        _starting[0] = False


def started_unpickling(flag: bool, light: bool = True) -> None:
    """The worker is (True) or is no longer (False) unpickling its source; ``light``: with the stand-ins."""
    _unpickling[0] = flag
    if flag:
        _stand_ins_off[0] = not light


@contextlib.contextmanager
def touching(what: Optional[str]) -> Iterator[None]:
    """While a stand-in loads the real module: ``what`` (``keras.utils.to_categorical``) needed it."""
    previous = getattr(_state, "touched", None)
    if previous is None:  # the outermost use is the one to name
        _state.touched = what
    try:
        yield
    finally:
        _state.touched = previous


def _pss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _skipped(filename: str) -> bool:
    if filename.startswith(("<frozen", "<string>", _HERE + os.sep)):  # importlib, the worker's -c, its machinery
        return True
    base = os.path.basename(os.path.dirname(filename))
    return base in _SKIP_NAMES or os.path.basename(filename) in _SKIP_NAMES


def _user_frame() -> Optional[Any]:
    """The innermost frame outside the worker's machinery, importlib and the picklers."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _skipped(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def describe_use(frame: Any, touched: Optional[str], unpickling: bool) -> tuple[str, str]:
    """``(text, when)``: where the framework was needed; ``when`` is ``"import"`` (a module's top level),
    ``"import line"`` (an import statement there: a submodule with no stand-in), ``"unpickle"`` (a framework
    name the pickled source refers to), ``"start-up"`` (a call while unpickling, ``__setstate__``, or in
    ``worker_init``) or ``"call"``."""
    what = f" (it touched `{touched}`)" if touched else ""
    if frame is None:
        if unpickling:
            return f"while it unpickled the source, which refers to the framework by name{what}", "unpickle"
        return f"in the worker{what}", "call"
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    line = line if len(line) <= 100 else line[:97] + "..."
    where = f"`{line}` at {code.co_filename}:{frame.f_lineno}" if line else f"{code.co_filename}:{frame.f_lineno}"
    where = f"because of {where}"
    if code.co_name == "<module>":
        module = frame.f_globals.get("__name__", "?")
        kind = "import line" if line.startswith(("import ", "from ")) else "import"
        return f"{where}, module level of `{module}`, run when the worker imports it{what}", kind
    return f"{where} in `{code.co_name}`{what}", "start-up" if unpickling or _starting[0] else "call"


_LIGHT_IMPORTS = (
    "the import lines themselves are free: kerasfeed's workers see light stand-ins for `keras`, `tensorflow`, "
    "`keras.utils.Sequence`/`PyDataset` and `tf.keras.utils.Sequence`, and names imported from them wait for "
    "their first use."
)


_NO_STAND_INS = (
    "kerasfeed's light stand-ins for `keras` and `tensorflow` were off in this worker (KERASFEED_LIGHT_FRAMEWORKS=0, "
    "or a Keras whose PyDataset differs from what they copy: the consumer's KerasStructureWarning says how), so "
    "naming Keras loads it."
)


def advice(when: str, names: list, touched: Optional[str] = None) -> str:
    """What a class can do about it."""
    if when in ("import", "unpickle") and names[0] in ("keras", "tensorflow") and _stand_ins_off[0]:
        return "Every worker pays this at start-up: " + _NO_STAND_INS
    if when == "import" and names[0] not in ("keras", "tensorflow"):
        return (
            f"Every worker pays this at start-up. To keep workers light, import {names[0]} inside the function "
            "that needs it, or make the items with numpy."
        )
    if when == "import line":
        return (
            "Every worker pays this at start-up. kerasfeed's light stand-ins cover `keras`, `keras.utils`, "
            "`tensorflow`, `tensorflow.keras` and `tensorflow.keras.utils`; importing another submodule at module "
            "level loads the framework. Write `import keras` (or `from keras import ops`) at the top and use "
            "`keras.ops.flip(...)` inside the function, or import the submodule inside the function that needs it."
        )
    if when == "import":
        return (
            "Every worker pays this at start-up. To keep workers light, keep framework calls out of module level "
            "(compute constants with numpy, or call the framework inside the function that needs it); "
            + _LIGHT_IMPORTS
        )
    if when == "unpickle":
        return (
            "Every worker pays this at start-up. Either the source's state holds a framework object (a Keras "
            "layer or model, a tensor): make it at its first use in `__getitem__` and leave it out of "
            "`__getstate__`, or use numpy; or a class defined in `__main__` or a notebook uses a name imported "
            "from the framework, which travels by reference and loads it: reach it through the module inside the "
            "function instead (`import keras` at the top, `keras.utils.to_categorical(...)` in `__getitem__`), or "
            "define the class in a module file; " + _LIGHT_IMPORTS
        )
    example = (
        " (`np.eye(num_classes, dtype='float32')[y]` for `to_categorical`)"
        if touched and touched.endswith("to_categorical")
        else " (or PIL/OpenCV for images)"
    )
    if when == "start-up":
        return (
            f"Every worker pays this at start-up, as it unpickles the source or runs worker_init. If it does not need "
            f"{'/'.join(names)} there, make it with numpy{example}, make it at its first use in `__getitem__`, or "
            "use executor='threads', where the framework is already loaded."
        )
    return (
        f"Every worker pays this once, at its first such item. If the item does not need {'/'.join(names)}, "
        f"make it with numpy{example}, or use executor='threads', where the framework is already loaded."
    )


def report(top: str, seconds: float, before: tuple, use: str, when: str, touched: Optional[str]) -> None:
    """Logs the warning once per framework, in worker 0 only (every worker does the same).
    ``before``: ``(PSS bytes or None, frameworks loaded already)`` when the import started."""
    info = worker_info.get_worker_info()
    if top in _reported or (info is not None and info.id != 0):
        return
    _reported.add(top)
    pss_before, had = before
    names = [top] + [m for m in WATCHED if m != top and m in sys.modules and m not in had]
    pss = _pss_bytes()
    mb = f", +{(pss - pss_before) / 2**20:.0f} MB PSS" if pss is not None and pss_before is not None else ""
    loaded = names[0] + (f" (with {', '.join(names[1:])})" if len(names) > 1 else "")
    logger.warning("kerasfeed: worker process 0 (pid %d) loaded %s %s: %.1f s%s per worker. %s",
                   os.getpid(), loaded, use, seconds, mb, advice(when, names, touched))


class TimedLoader:
    """Wraps the loader of a real framework import; put back on the module once it ran."""

    def __init__(self, spec: Any, loader: Any):
        self._spec = spec
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # create_module and the rest: the real loader's
        return getattr(self._loader, name)

    def exec_module(self, module: Any) -> None:
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        if depth == 0:  # the outermost framework import: the one that is timed and reported
            touched = getattr(_state, "touched", None)
            use, when = describe_use(_user_frame(), touched, _unpickling[0])
            before = (_pss_bytes(), {m for m in WATCHED if m in sys.modules and m != self._spec.name})
            t0 = time.perf_counter()
        try:
            self._loader.exec_module(module)
        finally:
            _state.depth = depth
            self._spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        if depth == 0:
            report(self._spec.name, time.perf_counter() - t0, before, use, when, touched)


__all__ = ["TimedLoader", "advice", "describe_use", "report", "started_unpickling", "touching"]
