"""A worker unpickles its source with light stand-ins for Keras and TensorFlow.

NOTE [ Light framework stand-ins in workers ]
=============================================

A user's ``keras.utils.Sequence``/``PyDataset`` subclass names Keras' class as
its base, so unpickling it (or importing its module) imports Keras and its
backend: ~3.7 s and ~400 MB per worker under TensorFlow, for a
``__getitem__`` that usually never touches Keras. ``loads`` (where the worker
unpickles the source) avoids that with two things:

- **Module stand-ins, only while unpickling.** ``keras``, ``keras.utils``,
  ``tensorflow``, ``tensorflow.keras`` and ``tensorflow.keras.utils`` are
  ``StandIn`` modules in ``sys.modules``, and leave it afterwards: later
  imports, ``"tensorflow" in sys.modules`` checks and the worker's Ready
  report see the real state; a module that bound one keeps it.
- **Class remapping.** A stand-in's ``Sequence``/``PyDataset``, and Keras'
  class named by reference in the pickle (a class pickled by value, from
  ``__main__`` or a notebook, names its base that way; ``_LIGHT_GLOBALS``),
  is kerasfeed's light ``PyDataset`` (``sources/_light_pydataset.py``: the
  same attributes, so the pickled state restores unchanged). It stays light
  after a real load: ``isinstance(self, keras.utils.Sequence)`` in the
  source's own code holds, ``isinstance(source, <the real PyDataset>)`` does
  not (Keras never sees the source in a worker).

Any other attribute of a stand-in is the real one, loaded on its first use.
While the worker unpickles (module imports, ``__setstate__``) it is a
``LazyName`` instead, because the import line ``from keras.utils import
to_categorical`` reads the attribute too and must stay free: the framework
loads when the name is called, read from or checked against, and the name
forwards from then on. Module globals are never rewritten, so a name bound
then stays a ``LazyName``: ``is`` fails against the real object, and a
framework function gets the real object for a direct argument
(``LazyName.__call__`` unwraps them) but not one nested in a container.
Importing another submodule while the stand-ins are in place (``import
keras.layers`` at a module's top) loads the real framework: ``_Finder`` hands
the import system the real module. One a pickle names (a function of a class
pickled by value that uses ``keras.ops``: cloudpickle imports it for its side
effect, or that a global binds: ``import keras.ops as kops``) is a module
whose attributes load the real one instead (``_import_module``).

Every real framework import is timed (``_Finder`` wraps the loader of
``tensorflow``, ``keras``, ``jax``, ``torch``; the outermost one counts) and
worker 0 warns once per framework: the use that pulled it in, its cost, and
advice (``frameworks.py``).

``KERASFEED_LIGHT_FRAMEWORKS=0`` turns the stand-ins off (plain unpickling).
So does the consumer where the Keras it loaded is not the one the light
``PyDataset`` copies (``stand_ins_fit``: its class moved, or its instances hold
other attributes; NOTE [ Keras' private structure ] item 6): a
``KerasStructureWarning`` once, then workers and Ray actors import Keras as
plain unpickling does, so that a source reads its real attributes there.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import io
import os
import pickle
import sys
import threading
import types
from typing import Any, Optional

from kerasfeed._keras_fit import report
from kerasfeed.execution.processes import frameworks
from kerasfeed.sources._light_pydataset import PyDataset, differences

_STAND_IN_TOPS = ("keras", "tensorflow")
# Dunders a stand-in answers from the real module; others are missing (tools probe them), and
# so is ``__file__`` for ``inspect``, which reads it from every module in sys.modules.
_REAL_DUNDERS = frozenset({"__version__", "__all__", "__file__", "__git_version__", "__compiler_version__"})
_CLASSES = {"Sequence": PyDataset, "PyDataset": PyDataset}
# name -> (attributes that are light, submodule stand-ins by attribute)
_LAYOUT = {
    "keras": ({}, {"utils": "keras.utils"}),
    "keras.utils": (_CLASSES, {}),
    "tensorflow": ({}, {"keras": "tensorflow.keras"}),
    "tensorflow.keras": ({}, {"utils": "tensorflow.keras.utils"}),
    "tensorflow.keras.utils": (_CLASSES, {}),
}
# Globals a pickle names by reference that resolve to the light class.
_LIGHT_GLOBALS = {
    ("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDataset"): PyDataset,
    ("keras.utils", "Sequence"): PyDataset,
    ("keras.utils", "PyDataset"): PyDataset,
}
# Modules cloudpickle names by reference (``subimport``) that are stand-ins under another name.
_ALIASES = {"keras._tf_keras.keras": "tensorflow.keras", "keras._tf_keras.keras.utils": "tensorflow.keras.utils"}

_lock = threading.RLock()
_installed: dict[str, "StandIn"] = {}  # the stand-ins now in sys.modules (while unpickling)


class StandIn(types.ModuleType):
    """A light stand-in for module ``name``; any attribute it does not hold loads the real module."""

    def __init__(self, name: str):
        super().__init__(name)
        light, subs = _LAYOUT[name]
        self.__dict__.update(light)
        # In the dict so that the import system never reaches __getattr__:
        # a package (``import keras.layers`` asks for ``__path__``) with a spec.
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        self.__loader__ = None
        self.__package__ = name
        for attr, sub in subs.items():
            setattr(self, attr, _installed.get(sub) or StandIn(sub))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__") and (
            attr not in _REAL_DUNDERS
            or (attr == "__file__" and sys._getframe(1).f_code.co_filename.endswith("inspect.py"))
        ):
            raise AttributeError(f"module {self.__name__!r} (kerasfeed's light stand-in) has no attribute {attr!r}")
        if _installed:  # unpickling: an import line, or a use that can wait
            return LazyName(self.__name__, attr)
        return getattr(load_real(self.__name__, f"{self.__name__}.{attr}"), attr)

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (kerasfeed's light stand-in: the real module loads on first use)>"


class LazyName:
    """A name imported from a stand-in (``from keras.utils import to_categorical``): the real
    object on first use (a call, an attribute, ``isinstance``, a base class), forwarded to."""

    __slots__ = ("_kf_module", "_kf_name", "_kf_obj")
    _MISSING = object()

    def __init__(self, module: str, name: str):
        self._kf_module, self._kf_name, self._kf_obj = module, name, LazyName._MISSING

    def _kf_real(self) -> Any:
        obj = self._kf_obj
        if obj is LazyName._MISSING:
            module, name = self._kf_module, self._kf_name
            obj = self._kf_obj = getattr(load_real(module, f"{module}.{name}"), name)
        return obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        real = self._kf_real()
        return real(*map(_real, args), **{k: _real(v) for k, v in kwargs.items()})

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._kf_real(), attr)

    def __getitem__(self, key: Any) -> Any:
        return self._kf_real()[key]

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._kf_real())

    def __subclasscheck__(self, cls: Any) -> bool:
        return issubclass(cls, self._kf_real())

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (self._kf_real(),)

    def __get__(self, instance: Any, owner: Any = None) -> Any:  # a class attribute: bound as the real one is
        real = self._kf_real()
        get = getattr(type(real), "__get__", None)
        return get(real, instance, owner) if get is not None else real

    def __eq__(self, other: Any) -> bool:
        return self._kf_real() == other

    def __hash__(self) -> int:
        return hash(self._kf_real())

    def __repr__(self) -> str:
        top = self._kf_module.partition(".")[0]
        return f"<{self._kf_module}.{self._kf_name} (kerasfeed: loads {top} on first use)>"


def load_real(name: str, touched: Optional[str] = None, *, module: bool = False) -> Any:
    """The real ``name``, imported if need be, after every stand-in left ``sys.modules``; ``touched``
    names the use that needed it. ``module``: the module of that name (an import statement); else
    the attribute path from the top-level module (``tf.keras.utils``, as the user's code reaches it:
    an attribute of TensorFlow, not always an importable module)."""
    with _lock:
        _withdraw()
    top, _, rest = name.partition(".")
    with frameworks.touching(touched):
        real = importlib.import_module(top)
        if module:
            return importlib.import_module(name)
        for part in rest.split(".") if rest else ():
            try:
                real = getattr(real, part)
            except AttributeError:
                real = importlib.import_module(f"{real.__name__}.{part}")
    return real


def _real(value: Any) -> Any:
    return value._kf_real() if type(value) is LazyName else value


def _install() -> None:
    if any(top in sys.modules for top in _STAND_IN_TOPS):
        return  # a real framework is here already (or stand-ins are): nothing to stand in for
    for name in reversed(_LAYOUT):  # submodules first: their parents hold them
        if name not in _installed:
            _installed[name] = StandIn(name)
    sys.modules.update(_installed)


def _withdraw() -> None:
    for name, stand_in in list(_installed.items()):
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
    _installed.clear()


class _Handoff:
    """Loader of a submodule under a stand-in: loads the real framework, returns the real module."""

    def create_module(self, spec):
        module = load_real(spec.name, spec.name, module=True)
        self._real_spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module) -> None:
        # The import system set our spec on the real module: put its own back.
        if self._real_spec is not None:
            module.__spec__ = self._real_spec


class _Finder:
    """First on ``sys.meta_path`` in a worker: submodules under a stand-in, and timed framework imports."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        top = name.partition(".")[0]
        if top in _STAND_IN_TOPS and _installed:
            return importlib.machinery.ModuleSpec(name, _Handoff())
        if name not in frameworks.WATCHED or name in sys.modules or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:  # the spec the finders after this one give
            meta = list(sys.meta_path)
            spec = None
            for other in meta[meta.index(self) + 1 :] if self in meta else meta:
                find = getattr(other, "find_spec", None)
                spec = find(name, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = frameworks.TimedLoader(spec, spec.loader)
        return spec


_finder = _Finder()


def _import_module(name: str, package: Optional[str] = None) -> Any:
    # How pickles name a module: cloudpickle's ``subimport(name)``, and ``importlib.import_module``
    # (TensorFlow's lazy ``tf.keras`` reduces to it); with Keras' other names for the stand-ins.
    if not _installed:
        return importlib.import_module(name, package)
    name = _ALIASES.get(name, name)
    if package is None and name not in _installed and name.partition(".")[0] in _STAND_IN_TOPS:
        # A submodule with no stand-in (``keras.ops``): cloudpickle names those a function uses by value,
        # to import them for their side effect, or one a global binds (``import keras.ops as kops``).
        # Importing it would load the framework now, for a ``__getitem__`` that may never use it: the
        # real one on first use instead, as an attribute of the real top-level module.
        return _LazySubmodule(name)
    return importlib.import_module(name, package)


class _LazySubmodule(types.ModuleType):
    """A framework submodule a pickle names (``_import_module``): a module (``inspect.ismodule`` holds) whose
    attributes are the real module's, loaded on first use. Not the real module itself (``is`` fails)."""

    def __init__(self, name: str):
        super().__init__(name)
        parent, _, attr = name.rpartition(".")
        self.__dict__["_kf_real"] = LazyName(parent, attr)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {self.__name__!r} (kerasfeed's lazy stand-in) has no attribute {attr!r}")
        return getattr(self.__dict__["_kf_real"]._kf_real(), attr)

    def __dir__(self) -> list:
        return dir(self.__dict__["_kf_real"]._kf_real())

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (kerasfeed: the real module loads on first use)>"


_MODULE_IMPORTERS = {("cloudpickle.cloudpickle", "subimport"), ("importlib", "import_module")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _installed:
            light = _LIGHT_GLOBALS.get((module, name))
            if light is not None:
                return light
            if (module, name) in _MODULE_IMPORTERS:
                return _import_module
            if module.partition(".")[0] in _STAND_IN_TOPS:  # e.g. a function imported in __main__
                with frameworks.touching(f"{module}.{name}"):
                    return super().find_class(module, name)
        return super().find_class(module, name)


_fits: Optional[bool] = None  # stand_ins_fit's answer, once a real Keras was there to check


def stand_ins_fit() -> bool:
    """Consumer side: whether the Keras loaded here is the one the light ``PyDataset`` copies (module, name,
    the attributes its instances hold); if not, a ``KerasStructureWarning`` once. True where no Keras is
    loaded: no source here has its class for a base."""
    global _fits
    if _fits is None:
        utils = sys.modules.get("keras.utils")
        real = None if utils is None or isinstance(utils, StandIn) else getattr(utils, "PyDataset", None)
        if real is None:
            return True
        found = differences(real)
        if found:
            report(f"{'; '.join(found)} (what kerasfeed's light stand-in for it copies in worker processes)",
                   "Worker processes and Ray actors unpickle sources without the stand-ins: each imports Keras and "
                   "its backend (seconds and hundreds of MB, once), and a source there reads Keras' own attributes.")
        _fits = not found
    return _fits


def worker_environment() -> dict:
    """What a worker process's environment gets beside the consumer's (``process.launch``): light unless the
    stand-ins do not fit this Keras (``stand_ins_fit``)."""
    if stand_ins_fit():
        return {"KERASFEED_LIGHT_WORKER": "1"}
    return {"KERASFEED_LIGHT_WORKER": "0", "KERASFEED_LIGHT_FRAMEWORKS": "0"}


def loads(payload: bytes, light: bool = True) -> Any:
    """Worker side: unpickles what ``pickling.dumps_for_workers`` made, with the stand-ins in place (unless
    ``light`` is false: ``stand_ins_fit`` in the consumer); also starts timing real framework imports in
    this process (for the warning)."""
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        light = light and os.environ.get("KERASFEED_LIGHT_FRAMEWORKS", "1") != "0"
        if light:
            _install()
    frameworks.started_unpickling(True, light)
    try:
        return _Unpickler(io.BytesIO(payload)).load()
    finally:
        frameworks.started_unpickling(False)
        with _lock:
            _withdraw()


__all__ = ["StandIn", "load_real", "loads", "stand_ins_fit", "worker_environment"]
