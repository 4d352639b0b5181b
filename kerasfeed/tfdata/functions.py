"""kerasfeed's tf.data functions: ``graph_fn`` marks them, and ``inline_map``, ``map_each``,
``parallel_map``, ``flat_map``, ``take_while`` and ``filter_by`` build the transformations that run them.

NOTE [ kerasfeed's functions are instantiated single-device ]
Every ``iter()`` of a dataset (Keras makes one per epoch) instantiates each function of its
pipeline, and a function inside a ``flat_map`` function again at every pass. tf.data instantiates
a function as a multi-device one, which runs Grappler over it every time. Measured (2 cores, `h5`,
200 stored items a pass, 2026-11-26): making an iterator cost 6.8 ms for the per-item reader
(``items._in_order``) and 25 ms for the stored-pass reader (``stored_items.py``), nearly all of it
Grappler (``perf``: ``OptimizeFunctionGraph`` under ``CapturedFunction::Instantiate``); with the
attribute below, 1.3 and 2.4 ms, the same elements at the same cost per item.

A function whose FunctionDef carries ``experimental_ints_on_device`` is instantiated single-device
(``FunctionMetadata::Create``, ``tensorflow/core/data/captured_function.cc``): no Grappler, no
placement. kerasfeed's functions run on the iterator's CPU device and capture no resource on
another device, which is what multi-device instantiation is for; the attribute's own meaning
(int32 tensors kept in device memory) is host memory on a CPU. tf.data's public transformations
take no function attributes, so these build the same dataset ops through tf.data's private
classes. Where a TensorFlow lacks them, each falls back to the public transformation (the same
elements, slower iterators), saying so once in the log.

Not for a function that takes or returns int32 tensors: those become ``_DeviceArg``/``_DeviceRetval``
nodes, and tf.data's graph rewrite then takes a stateless one for a pipeline of its own and fails
the iterator ("Expected only one fetch node", TensorFlow 2.21, a map returning (float32, int32)).
Such a function is made multi-device (its transformation otherwise the same), without a word.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import tensorflow as tf

logger = logging.getLogger("kerasfeed")

_SINGLE_DEVICE = {"experimental_ints_on_device": True}  # NOTE above

try:  # tf.data's private classes (NOTE above)
    from tensorflow.python.data.ops import dataset_ops as _dataset_ops
    from tensorflow.python.data.ops import structured_function as _structured
    from tensorflow.python.data.util import structure as _structure
    from tensorflow.python.ops import gen_dataset_ops as _gen
    from tensorflow.python.ops import gen_experimental_dataset_ops as _gen_experimental

    _Unary: Any = _dataset_ops.UnaryDataset
except (ImportError, AttributeError):  # pragma: no cover - other TensorFlow versions
    _Unary = None

_fell_back: list = []  # the first fallback's reason, logged once


def graph_fn(fn: Any) -> Any:
    """Marks a function kerasfeed gives to tf.data as not for AutoGraph.

    AutoGraph writes a ``__autograph_generated_file*.py`` into ``$TMPDIR`` per
    function tf.data traces, removed at a normal exit only (a killed process
    leaves them). kerasfeed's functions have no tensor-dependent Python
    control flow: every one passed to ``map``, ``flat_map`` and the like goes
    through this (and what it calls is not converted either).
    """
    return tf.autograph.experimental.do_not_convert(fn)


def inline_map(ds: tf.data.Dataset, fn: Any) -> tf.data.Dataset:
    """A sequential ``ds.map(fn)`` whose function runs on the calling thread.

    A plain sequential map hands each call's ops to TensorFlow's inter-op
    pool: one more thread wake-up per element, whose spinning workers take
    CPU that worker processes need on a small machine (measured on 2 cores:
    ~100 us less main-process CPU per element inline, with the same
    elements).
    """
    return _own(ds, fn, "map", lambda: ds.map(graph_fn(fn)), use_inter_op_parallelism=False,
                preserve_cardinality=True, force_synchronous=False)


def map_each(ds: tf.data.Dataset, fn: Any) -> tf.data.Dataset:
    """``ds.map(fn)`` (sequential, its ops on TensorFlow's inter-op pool)."""
    return _own(ds, fn, "map", lambda: ds.map(graph_fn(fn)), use_inter_op_parallelism=True,
                preserve_cardinality=True, force_synchronous=False)


def parallel_map(ds: tf.data.Dataset, fn: Any, calls: int) -> tf.data.Dataset:
    """``ds.map(fn, num_parallel_calls=calls, deterministic=True)``."""
    return _own(ds, fn, "parallel_map", lambda: ds.map(graph_fn(fn), num_parallel_calls=calls, deterministic=True),
                num_parallel_calls=tf.constant(calls, tf.int64), deterministic="true", preserve_cardinality=True)


def flat_map(ds: tf.data.Dataset, fn: Any) -> tf.data.Dataset:
    """``ds.flat_map(fn)``."""
    return _own(ds, fn, "flat_map", lambda: ds.flat_map(graph_fn(fn)))


def take_while(ds: tf.data.Dataset, predicate: Any) -> tf.data.Dataset:
    """``ds.take_while(predicate)``."""
    return _own(ds, predicate, "take_while", lambda: ds.take_while(graph_fn(predicate)))


def filter_by(ds: tf.data.Dataset, predicate: Any) -> tf.data.Dataset:
    """``ds.filter(predicate)``."""
    return _own(ds, predicate, "filter", lambda: ds.filter(graph_fn(predicate)))


def _own(ds: tf.data.Dataset, fn: Any, kind: str, public: Callable[[], tf.data.Dataset], **attrs: Any
         ) -> tf.data.Dataset:
    """The transformation ``kind`` over ``fn`` made single-device, or ``public()`` where this
    TensorFlow's private classes differ (NOTE above)."""
    if _Unary is None:
        return _fall_back(public, "tf.data's private dataset classes are missing")
    try:
        return _Transformation(ds, fn, kind, attrs)
    except (AttributeError, TypeError) as e:  # another TensorFlow's op or class signatures
        return _fall_back(public, f"{type(e).__name__}: {e}")


def _fall_back(public: Callable[[], tf.data.Dataset], why: str) -> tf.data.Dataset:
    if not _fell_back:
        _fell_back.append(why)
        logger.warning("kerasfeed: TensorFlow %s: its functions are made multi-device (Grappler at every iterator: "
                       "~5-25 ms more each epoch; the same elements), because %s", tf.__version__, why)
    return public()


def stays_multi_device(structure: Any) -> bool:
    """Whether a function that takes or returns ``structure`` (an element spec, a tuple of specs) is
    made multi-device: it holds int32 tensors, or this TensorFlow lacks the private classes (NOTE above)."""
    if _Unary is None:
        return True
    return any(s.dtype == tf.int32 for s in _structure.get_flat_tensor_specs(structure))


# kind: (the dataset op, the name of its function's argument)
_OPS = {"map": ("map_dataset", "f"), "parallel_map": ("parallel_map_dataset_v2", "f"),
        "flat_map": ("flat_map_dataset", "f"), "take_while": ("take_while_dataset", "predicate"),
        "filter": ("filter_dataset", "predicate")}


class _Transformation(_Unary or object):  # type: ignore[misc]
    """One of ``_OPS`` over a function whose FunctionDef is marked single-device, unless it takes
    or returns int32 tensors (as tf.data's own ``_MapDataset``, ``_FlatMapDataset``...; their
    element specs)."""

    def __init__(self, ds: tf.data.Dataset, fn: Any, kind: str, attrs: dict) -> None:
        self._input_dataset, self._name, self.kind = ds, None, kind
        self.single_device = not stays_multi_device(ds.element_spec)
        self._func = self._wrap(fn, ds)
        if self.single_device and stays_multi_device(self._func.output_structure):  # made again, multi-device
            self.single_device = False
            self._func = self._wrap(fn, ds)
        out = self._func.output_structure
        if kind == "flat_map":
            if not isinstance(out, tf.data.DatasetSpec):
                raise ValueError(f"kerasfeed: a flat_map function must return a tf.data.Dataset. Received: {out!r}")
            self._spec = out._element_spec
        elif kind in ("map", "parallel_map"):
            self._spec = out
        else:
            if not out.is_compatible_with(tf.TensorSpec([], tf.bool)):
                raise ValueError(f"kerasfeed: a {kind} predicate must return a scalar tf.bool. Received: {out!r}")
            self._spec = ds.element_spec
        name, fn_arg = _OPS[kind]
        op = getattr(_gen if hasattr(_gen, name) else _gen_experimental, name)
        variant = op(ds._variant_tensor, self._func.function.captured_inputs, **{fn_arg: self._func.function}, **attrs,
                     **self._common_args)
        super().__init__(ds, variant)

    def _wrap(self, fn: Any, ds: tf.data.Dataset) -> Any:
        return _structured.StructuredFunctionWrapper(graph_fn(fn), f"kerasfeed.{self.kind}()", dataset=ds,
                                                     defun_kwargs=dict(_SINGLE_DEVICE) if self.single_device else None)

    def _functions(self) -> list:
        return [self._func]

    @property
    def element_spec(self) -> Any:
        return self._spec


__all__ = ["filter_by", "flat_map", "graph_fn", "inline_map", "map_each", "parallel_map", "stays_multi_device",
           "take_while"]
