"""Device prefetch for ``to_loader``: batches on the accelerator before the step asks.

NOTE [ Device prefetch ]
========================

Without it, the training thread itself moves every batch to the device,
taking the GIL and its own time: Keras' JAX trainer calls ``jax.device_put``
on each numpy batch (on an accelerator one batch ahead,
``_one_batch_ahead_iterator``; under a distribution
``jax.make_array_from_process_local_data`` with the data layout); Keras'
PyTorch layers call ``tensor.to(device)`` from pageable memory, which blocks.
With ``device_prefetch=N`` a thread of the loader reads batches ahead and
places the next ``N`` on the device:

- **JAX** (``get_jax_iterator``, ``loader.jax()``): ``jax.device_put`` with
  what Keras would use itself, captured in the training thread when the
  iterator is made (Keras' global state is per thread): no distribution ->
  the default device (uncommitted, as Keras does); a distribution in one
  process -> ``distribution.get_data_layout(shape).backend_layout`` per
  array. Keras' own placement then finds the array where it belongs and
  returns it as is (``jax.device_put`` and, in one process,
  ``make_array_from_process_local_data`` hand back the same array): no
  second copy. Over several processes Keras assembles the global batch from
  each process's numpy batch, so the batches stay numpy. Batches the mesh
  cannot split are refused before the first step when their sizes are known
  (``Loader.check_batches``); one that still cannot be placed (items that
  are batches of varying size) stays numpy, for Keras to handle as without
  prefetch.
- **PyTorch** (``get_torch_dataloader``, ``loader.torch()``): on CUDA the
  thread copies each array into pinned memory with numpy (``host_copy``)
  and starts a non-blocking copy on a stream of its own; the training
  thread's stream waits for that copy (an event) and the tensors are marked
  used on it (``record_stream``), so the caching allocator never reuses them
  early; Keras' ``convert_to_tensor`` then finds them on its device: no
  copy. Not torch's own ``pin_memory()``: it copies on torch's intra-op
  pool, whose threads then spin; on the 16-core GPU machine (2026-11-23)
  that took ~150 ms of CPU per batch from the workers, and ``fit`` ran at
  0.57-0.83 of the in-memory rate (0.82-0.97 with numpy's copy, 15 workers,
  ``decode``). Other devices: a plain ``.to(device)`` in the thread; the
  CPU: tensors sharing the numpy memory (``torch.from_numpy``).

``device_prefetch=None`` (the default) is 2 when the batches go to an
accelerator (JAX's default backend, or the torch device, is not the CPU) and
0 on a CPU, where a device copy is no copy and the thread only costs. The
thread reads at most ``N + 1`` batches beyond what the step took; the pass
keeps that many (plus the one Keras' JAX trainer reads ahead) for Keras'
model-build replay (``passes.py``). A prefetch thread stops when its
iterator is dropped (Keras drops it at the end of every epoch).
``kerasfeed.stats(loader)["device"]`` reports how long the training thread
blocked for a placed batch (the step waiting on input); the pipeline's own
``wait_ms`` is then the prefetch thread's.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed._keras_fit import report
from kerasfeed.execution import thread_tasks
from kerasfeed.loader.convert import TorchBatches, cpu_tensor, map_arrays, torch_dtype

# Batches placed ahead when device_prefetch=None and the batches go to an accelerator.
ACCELERATOR_DEPTH = 2
# Batches Keras' JAX trainer reads ahead on an accelerator (its _one_batch_ahead_iterator)
# before the step asks: a model build takes two.
JAX_KERAS_AHEAD = 2
_SLICE_S = 0.1  # waits in slices: a dropped iterator stops its thread
_RECENT = 4096


def check_depth(value: Any) -> Optional[int]:
    """``device_prefetch``: None (2 on an accelerator, else 0) or an int >= 0 (0: off)."""
    return _v.non_negative_int("device_prefetch", value, allow_none=True, owner="to_loader")


class DeviceStats:
    """What the training thread waited for a placed batch (``stats(loader)["device"]``)."""

    def __init__(self):
        self.depth: Optional[int] = None
        self.target = ""
        self.batches = 0
        self.ready = 0
        self.wait_total_s = 0.0
        self.waits: collections.deque = collections.deque(maxlen=_RECENT)
        self.places: collections.deque = collections.deque(maxlen=_RECENT)

    def got(self, wait_s: float) -> None:
        self.batches += 1
        self.ready += wait_s < 1e-4
        self.wait_total_s += wait_s
        self.waits.append(wait_s)

    def snapshot(self) -> dict:
        def ms(values: collections.deque) -> Optional[dict]:
            v = np.fromiter(list(values), dtype=np.float64)
            if not v.size:
                return None
            p50, p95 = np.percentile(v, (50, 95)) * 1e3
            return {"mean": float(v.mean() * 1e3), "p50": float(p50), "p95": float(p95), "max": float(v.max() * 1e3)}

        return {
            "prefetch": self.depth,
            "target": self.target,
            "batches": self.batches,
            "wait_total_s": self.wait_total_s,
            "wait_ms": ms(self.waits),
            "ready_fraction": self.ready / self.batches if self.batches else None,
            "place_ms": ms(self.places),
        }


class _Feed:
    """The prefetch thread's side: no reference to the iterator the step holds,
    so dropping that iterator stops the thread."""

    def __init__(self, source: Iterator[Any], place: Callable[[Any], Any], depth: int, stats: DeviceStats,
                 waits: Any = None):
        self.source = source
        self.place = place
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.stats = stats
        self.thread: Optional[threading.Thread] = None
        self.waits = waits  # the executor's WaitScope

    def stop_at_exit(self) -> None:  # NOTE [ Pool threads at exit ]: the iterator may live on to the end
        self.stop.set()
        if self.waits is not None:  # a load waiting on a worker process (closed only after this hook) gives up
            self.waits.cancel()

    def alive(self) -> list[threading.Thread]:
        return thread_tasks.running(self.thread)

    def run(self) -> None:
        try:
            for batch in self.source:
                t0 = time.perf_counter()
                placed = self.place(batch)
                self.stats.places.append(time.perf_counter() - t0)
                del batch
                if not self._put(("batch", placed)):
                    return
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 - raised in the training thread
            self._put(("error", e))
        finally:
            self.source = None  # the pass iterator (and what it holds) goes at once

    def _put(self, item: tuple) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_SLICE_S)
                return True
            except queue.Full:
                continue
        return False


class DeviceIterator:
    """Batches placed ahead on a thread; ``next`` hands over the oldest.

    Args:
        source: the pass iterator (``passes.PassIterator``: numpy batches).
        place: turns a numpy batch into a placed one (runs on the thread).
        depth: placed batches kept ready (>= 1).
        stats: where the training thread's waits are counted.
        finish: runs on the training thread on each placed batch before it
            is handed over (PyTorch: the stream waits for the copy).
        waits: the executor's ``WaitScope``: the exit ends a load under way.
    """

    def __init__(
        self,
        source: Iterator[Any],
        place: Callable[[Any], Any],
        depth: int,
        stats: DeviceStats,
        finish: Optional[Callable[[Any], Any]] = None,
        waits: Any = None,
    ):
        self._feed = _Feed(source, place, depth, stats, waits)
        # NOTE [ A prefetch thread is not the consumer ]: the thread reads the pass iterator ahead, also
        # after a model build gave this iterator up; only the training thread's own next() means that
        # Keras went on with it (``Passes.carry_on``), or the next iterator would not take the pass over.
        source.prefetched = True
        self._carry_on = source.carry_on
        self._stats = stats
        self._finish = finish
        self._done = False
        weakref.finalize(self, self._feed.stop.set)

    def __iter__(self) -> "DeviceIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        self._carry_on()
        feed = self._feed
        if feed.thread is None:  # the pass starts on the first next, as without prefetch
            feed.thread = threading.Thread(target=feed.run, name="kerasfeed-device-prefetch", daemon=True)
            thread_tasks.join_at_exit(feed)
            feed.thread.start()
        t0 = time.perf_counter()
        while True:
            try:
                kind, value = feed.queue.get(timeout=_SLICE_S)
                break
            except queue.Empty:
                if not feed.thread.is_alive() and feed.queue.empty():
                    self._done = True
                    raise RuntimeError("kerasfeed: the device prefetch thread ended without a batch or an error.")
        if kind != "batch":  # "end" or "error"
            self._done = True
            if kind == "end":
                raise StopIteration
            raise value
        self._stats.got(time.perf_counter() - t0)
        return self._finish(value) if self._finish is not None else value


def _jax_place(device: Any, keras: bool) -> tuple[Optional[Callable[[Any], Any]], str]:
    """Where a batch goes (``keras``: where Keras' JAX trainer would put it),
    as a function for the thread, and that place in words.

    Called in the training thread (Keras' distribution and JAX's default
    device are per-thread settings). None when batches must stay numpy.
    """
    import jax

    if device is None and keras:
        from keras.distribution import distribution

        dist = distribution()
        if dist is not None:
            if jax.process_count() > 1:
                return None, "numpy (Keras assembles the global batch from every process's numpy batch)"
            layouts: dict = {}

            def put_sharded(a: np.ndarray) -> Any:
                layout = layouts.get(a.shape)
                if layout is None:
                    layout = layouts[a.shape] = dist.get_data_layout(a.shape).backend_layout
                return jax.device_put(a, layout)

            return _leafwise(put_sharded), f"{type(dist).__name__} data layout"
    if device is None:
        device = jax.config.jax_default_device  # None: the uncommitted default, as Keras puts it
    elif not keras:
        _check_jax_device(jax, device)

    def put(a: np.ndarray) -> Any:
        return jax.device_put(a, device) if device is not None else jax.device_put(a)

    # A device the user named is placed on or fails; only Keras' own placing is lenient (see _leafwise).
    return _leafwise(put, lenient=keras), str(device) if device is not None else f"default device ({jax.devices()[0]})"


def _check_jax_device(jax: Any, device: Any) -> None:
    """Refuses a ``loader.jax(device)`` JAX cannot place on (a string such as ``"cpu"``): its batches came out
    as numpy arrays, silently (the placing caught JAX's ValueError, meant for a Keras batch a mesh cannot split)."""
    try:
        jax.device_put(np.zeros((), np.float32), device)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"loader.jax: `device` must be a jax.Device or a jax.sharding.Sharding (e.g. "
                         f"jax.devices('cpu')[0]), one JAX can place arrays on: {type(e).__name__}: {e} "
                         f"Received: device={device!r}") from None


def _leafwise(put: Callable[[np.ndarray], Any], lenient: bool = True) -> Callable[[Any], Any]:
    def place(batch: Any) -> Any:
        try:
            return map_arrays(lambda a: a if a.dtype == object else put(a), batch)
        except ValueError:  # e.g. a last batch the mesh cannot split: Keras reports it itself
            if not lenient:
                raise
            return batch

    return place


class _TorchPlace:
    """Numpy batch -> tensors on ``device``: pinned and non-blocking on CUDA (see the NOTE)."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def _tensor(self, a: np.ndarray) -> Any:
        if self.cuda and a.dtype != object:
            return host_copy(self.torch, a, pin=True).to(self.device, non_blocking=True)
        x = cpu_tensor(self.torch, a)
        return x if a.dtype == object or self.device.type == "cpu" else x.to(self.device)

    def __call__(self, batch: Any) -> tuple[Any, Any]:  # the prefetch thread
        if not self.cuda:
            return map_arrays(self._tensor, batch), None
        with self.torch.cuda.stream(self.stream):
            out = map_arrays(self._tensor, batch)
            event = self.torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def finish(self, placed: tuple[Any, Any]) -> Any:  # the training thread
        out, event = placed
        if event is not None:
            current = self.torch.cuda.current_stream(self.device)
            current.wait_event(event)
            map_arrays(lambda t: t.record_stream(current) if isinstance(t, self.torch.Tensor) else t, out)
        return out


def host_copy(torch: Any, a: np.ndarray, pin: bool) -> Any:
    """A torch CPU tensor holding a copy of ``a`` (in pinned memory if ``pin``), filled by numpy.

    Not ``torch.from_numpy(a).pin_memory()``: torch copies on its intra-op pool, whose threads spin
    between copies (one copy per batch kept every core spinning: NOTE [ Device prefetch ]); numpy
    copies on the calling thread with the GIL released.
    """
    dtype, view = torch_dtype(torch, a.dtype)  # TypeError for what torch cannot hold
    host = torch.empty(a.shape, dtype=dtype, pin_memory=pin)
    same = host if view == a.dtype else host.view(torch_dtype(torch, view)[0])  # bfloat16: its bytes as int16
    np.copyto(same.numpy(), a.view(view), casting="no")
    return host


def torch_device(keras_backend: bool) -> Any:
    """Where torch batches go: Keras' torch device (its trainer), else the current CUDA device or the CPU."""
    if keras_backend:
        try:
            from keras.src.backend.torch.core import get_device  # Keras' per-thread device (device_scope)

            return get_device()
        except ImportError:  # private Keras structure (NOTE [ Keras' private structure ], _keras_fit.py)
            report("its torch backend has no keras.src.backend.torch.core.get_device", "Batches go to the current "
                   "CUDA device (or the CPU), which may not be the device a keras.device() scope chose.")
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class TorchDeviceBatches(TorchBatches):
    """A loader's batches as torch tensors on ``device``, placed ``depth`` ahead."""

    def __init__(self, loader: Any, feed: "DeviceFeed", device: Any, depth: int):
        super().__init__(loader)
        self._feed, self._device, self._depth = feed, device, depth

    def __iter__(self) -> Iterator[Any]:
        place = _TorchPlace(self._device)
        self._feed.stats.depth, self._feed.stats.target = self._depth, str(place.device)
        if self._depth == 0:  # placed in this thread, as asked for
            return (place.finish(place(batch)) for batch in self._feed.passes.iterator())
        source = self._feed.passes.iterator(keep=1 + self._depth + 1)
        return DeviceIterator(source, place, self._depth, self._feed.stats, place.finish, self._feed.waits)


class DeviceFeed:
    """A loader's device prefetch: the option (``depth``, from ``check_depth``), the stats (to the
    loader's ``StatsCollector``, ``collector``; None: off) and the iterators over its ``passes``, whose loads
    wait in ``waits`` (the executor's ``WaitScope``, or None)."""

    def __init__(self, depth: Optional[int], passes: Any, collector: Any, waits: Any = None):
        self.depth = depth
        self.passes = passes
        self.waits = waits
        self.stats = DeviceStats()
        if collector is not None:
            collector.add_gauges(self.gauges)

    def gauges(self) -> dict:
        return {"device": self.stats.snapshot()}

    def _resolve(self, accelerator: bool) -> int:
        return self.depth if self.depth is not None else (ACCELERATOR_DEPTH if accelerator else 0)

    def keras_jax(self) -> Iterator[Any]:
        """What Keras' JAX trainer drains: numpy batches, or placed ones with prefetch."""
        import jax

        depth = self._resolve(jax.default_backend() != "cpu")
        keep = JAX_KERAS_AHEAD + (depth + 1 if depth else 0)
        place, target = _jax_place(None, keras=True) if depth else (None, "numpy (Keras places them)")
        self.stats.depth, self.stats.target = (depth if place is not None else 0), target
        source = self.passes.iterator(keep=keep)
        return source if place is None else DeviceIterator(source, place, depth, self.stats, waits=self.waits)

    def jax(self, device: Any = None) -> Iterator[Any]:
        """``loader.jax(device)``: JAX arrays on ``device`` (the default device if None)."""
        import jax

        depth = self._resolve(jax.default_backend() != "cpu")
        place, target = _jax_place(device, keras=False)
        self.stats.depth, self.stats.target = depth, target
        if depth == 0:
            return map(place, self.passes.iterator())
        return DeviceIterator(self.passes.iterator(keep=depth + 2), place, depth, self.stats, waits=self.waits)

    def torch(self, loader: Any, device: Any = None, keras_backend: bool = False) -> TorchBatches:
        """``loader.torch(device)`` / what Keras' PyTorch trainer drains (``keras_backend=True``)."""
        import torch

        explicit = device is not None
        device = _torch_device(torch, torch_device(keras_backend) if device is None else device)
        depth = self._resolve(device.type != "cpu")
        if depth == 0 and (device.type == "cpu" or not explicit):
            return TorchBatches(loader)  # tensors sharing the numpy memory; Keras moves them itself
        return TorchDeviceBatches(loader, self, device, depth)


def _torch_device(torch: Any, device: Any) -> Any:
    """``torch.device(device)``, refused in kerasfeed's words when torch cannot use it (no such device type,
    a CUDA device on a torch without CUDA: torch's own errors named neither the argument nor the call)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"loader.torch: `device` must be a torch device such as 'cpu' or 'cuda:0': {e} "
                         f"Received: device={device!r}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("loader.torch: `device` is a CUDA device, and this torch has none (a CPU-only build, or no "
                         f"GPU visible). Pass device='cpu' or None. Received: device={device!r}")
    return parsed


__all__ = [
    "ACCELERATOR_DEPTH",
    "DeviceFeed",
    "DeviceIterator",
    "DeviceStats",
    "TorchDeviceBatches",
    "check_depth",
    "host_copy",
    "torch_device",
]
