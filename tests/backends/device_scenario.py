"""Device prefetch (``to_loader(..., device_prefetch=N)``) under one Keras backend, in one process.

Run as ``KERAS_BACKEND=<jax|torch> python device_scenario.py RESULT.json``;
for JAX with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (two
CPU devices stand in for accelerators). The reference is the loader's own
numpy batches without prefetch; training checks are exact (``scenario.py``:
plain SGD on a linear model, replayed in numpy). An accelerator is
emulated for Keras' JAX trainer by reporting a "gpu" default backend: Keras
then reads one batch ahead (``_one_batch_ahead_iterator``) and kerasfeed
prefetches 2 by default. The script asserts as it goes and writes what it
observed to ``RESULT.json``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import sys
import threading
import time

import numpy as np
from scenario import B0, EPOCHS, LR, SEED, W0, Rows, _close, _model, sgd

import kerasfeed


def _unbuilt(keras):
    """A model Keras builds from the first batch (its build reads a throwaway iterator)."""
    dense = keras.layers.Dense(
        1,
        kernel_initializer=lambda shape, dtype=None: keras.ops.convert_to_tensor(W0),
        bias_initializer=lambda shape, dtype=None: keras.ops.convert_to_tensor(B0),
    )
    model = keras.Sequential([dense])
    model.compile(keras.optimizers.SGD(LR), "mse")
    return model


def _numpy_passes(**kwargs):
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, device_prefetch=0, **kwargs) as loader:
        return [[(np.asarray(x), np.asarray(y)) for x, y in loader] for _ in range(EPOCHS + 1)]


def _same(batches, reference, what):
    assert len(batches) == len(reference), (what, len(batches), len(reference))
    for k, ((x, y), (rx, ry)) in enumerate(zip(batches, reference)):
        assert np.array_equal(np.asarray(x), rx) and np.array_equal(np.asarray(y), ry), (what, k)


def _fit_exact(keras, loader_kwargs, rows, out_key, out, unbuilt=True):
    """fit 2 epochs on a fresh loader: the weights say which batches, in which order."""
    seq = Rows()
    with kerasfeed.to_loader(seq, shuffle=True, seed=SEED, **loader_kwargs) as loader:
        model = _unbuilt(keras) if unbuilt else _model(keras)
        model.fit(loader, epochs=EPOCHS, verbose=0)
        device = kerasfeed.stats(loader)["device"]
    w, b = sgd(W0, B0, rows[0] + rows[1])
    _close(model.get_weights()[0], w, f"{out_key} weights")
    _close(model.get_weights()[1], b, f"{out_key} bias")
    assert seq.passes_begun == [0, 1], (out_key, seq.passes_begun)  # the build consumed no pass
    out[out_key] = {"prefetch": device["prefetch"], "batches": device["batches"]}
    return device


def _resume_exact(keras, loader_kwargs, rows):
    w1, b1 = sgd(W0, B0, rows[0] + rows[1][:3])
    w, b = sgd(W0, B0, rows[0] + rows[1])
    model = _model(keras)
    model.set_weights([w1.astype("float32"), b1.astype("float32")])
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state={"epoch": 1, "batches": 3}, **loader_kwargs) as resumed:
        model.fit(resumed, initial_epoch=1, epochs=2, verbose=0)
    _close(model.get_weights()[0], w, "resumed weights")


def _item_error(keras, loader_kwargs):
    with kerasfeed.to_loader(Rows(bad_index=5), **loader_kwargs) as bad:
        try:
            _model(keras).fit(bad, epochs=1, verbose=0)
        except kerasfeed.ItemError as e:
            assert e.index == 5 and "cannot read batch 5" in str(e), str(e)[:300]
            return "ItemError"
    raise AssertionError("fit over a failing item did not raise")


def _samples(n):
    """``n`` single samples ``(x, y)`` for ``_model``, to be batched (a list is a source too)."""
    return [(np.full(3, i / n, "float32"), np.full(1, 0.5, "float32")) for i in range(n)]


def _indivisible(keras, late):
    """Under DataParallel over two devices: batches of 3, or a short last batch
    of 1, are refused when a loader is made, and a loader made before the
    distribution was set is refused when fit begins the epoch, before its first
    step: the model keeps its variables and trains on."""
    refused = []
    for kwargs in ({"batch_size": 3}, {"batch_size": 2}):
        try:
            kerasfeed.to_loader(_samples(7), **kwargs)
        except ValueError as e:
            refused.append(re.split(r"\. (?:Use|Pass) ", str(e).split(": ", 1)[1])[0])
    model = _model(keras)
    try:
        model.fit(late, epochs=1, verbose=0)
    except ValueError as e:
        refused.append(re.split(r"\. (?:Use|Pass) ", str(e).split(": ", 1)[1])[0])
    _close(model.get_weights()[0], W0, "weights after the refused fit")
    # Items that are batches whose sizes vary (the probes know no size): each is checked as it is read;
    # before, JAX's IndivisibleError came from inside the step.
    varying = [(np.zeros((n, 3), "float32"), np.zeros((n, 1), "float32")) for n in (2, 4, 2, 3, 2, 2)]
    with kerasfeed.to_loader(varying) as loader:
        try:
            _model(keras).fit(loader, epochs=1, verbose=0)
        except ValueError as e:
            refused.append(re.split(r"\. (?:Use|Pass|Return) ", str(e).split(": ", 1)[1])[0])
    with kerasfeed.to_loader(_samples(8), batch_size=2) as fine:
        model.fit(fine, epochs=1, verbose=0)
    assert not np.allclose(model.get_weights()[0], W0), "the model did not train after the refused fit"
    return refused


def _no_prefetch_threads_left():
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        left = [t.name for t in threading.enumerate() if t.name == "kerasfeed-device-prefetch"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def _emulated_accelerator():
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "gpu"  # Keras' JAX trainer and kerasfeed ask this way
    try:
        yield
    finally:
        jax.default_backend = real


def run_jax(keras, out):
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    assert len(jax.devices()) == 2, jax.devices()
    rows = _numpy_passes()
    # Placed on the default device, same values in the same order; Keras' own
    # placement hands the same arrays back (no second copy).
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, device_prefetch=2) as loader:
        got = list(loader.get_jax_iterator())
        assert all(isinstance(a, jax.Array) for batch in got for a in batch)
        assert {a.sharding for batch in got for a in batch} == {jax.sharding.SingleDeviceSharding(jax.devices()[0])}
        _same(got, rows[0], "pass 0 through device prefetch")
        batch = got[0]
        assert all(a is b for a, b in zip(_distribute_data(batch), batch))
        assert isinstance(next(iter(loader)), tuple) and isinstance(next(iter(loader))[0], np.ndarray)  # iter(): numpy
    # CPU default: no prefetch, numpy batches (Keras places them).
    with kerasfeed.to_loader(Rows(), device_prefetch=None) as loader:
        assert isinstance(next(loader.get_jax_iterator())[0], np.ndarray)
        assert kerasfeed.stats(loader)["device"]["prefetch"] == 0

    _fit_exact(keras, {"device_prefetch": 2}, rows, "fit_prefetch", out)
    with _emulated_accelerator():  # Keras reads one batch ahead; kerasfeed prefetches 2 by default
        _fit_exact(keras, {}, rows, "fit_accelerator_default", out)
        _fit_exact(keras, {"device_prefetch": 0}, rows, "fit_accelerator_no_prefetch", out)
    _resume_exact(keras, {"device_prefetch": 2}, rows)

    # Keras' data parallelism over the two devices: batches arrive with its data sharding.
    late = kerasfeed.to_loader(_samples(7), batch_size=2)  # made before the distribution is set
    dist = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(dist)
    try:
        out["indivisible"] = _indivisible(keras, late)
        with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, device_prefetch=2) as loader:
            got = list(loader.get_jax_iterator())
            _same(got, rows[0], "pass 0 under DataParallel")
            x = got[0][0]
            assert x.sharding == dist.get_data_layout(x.shape).backend_layout, x.sharding
            assert len({s.device for s in x.addressable_shards}) == 2 and x.addressable_shards[0].data.shape[0] == 2
            layouts = tuple(dist.get_data_layout(a.shape).backend_layout for a in got[0])
            assert all(a is b for a, b in zip(_distribute_data(got[0], layouts), got[0]))
            out["sharded_target"] = kerasfeed.stats(loader)["device"]["target"]
        _fit_exact(keras, {"device_prefetch": 2}, rows, "fit_data_parallel", out, unbuilt=False)
        _resume_exact(keras, {"device_prefetch": 2}, rows)
    finally:
        keras.distribution.set_distribution(None)
        late.close()
    out["error_type"] = _item_error(keras, {"device_prefetch": 2})


def run_torch(keras, out):
    import torch

    rows = _numpy_passes()
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, device_prefetch=2) as loader:
        got = list(loader.get_torch_dataloader())
        assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for batch in got for t in batch)
        _same(got, rows[0], "pass 0 through torch prefetch")
        assert type(loader.get_torch_dataloader()).__name__ == "TorchDeviceBatches"
        assert len(loader.get_torch_dataloader()) == len(rows[0])
        _same(list(loader.torch(device="cpu")), rows[1], "pass 1 through .torch(device='cpu')")
    with kerasfeed.to_loader(Rows()) as plain:  # CPU default: the tensors share the numpy memory
        assert type(plain.torch()).__name__ == "TorchBatches" and type(plain.get_torch_dataloader()).__name__ == "TorchBatches"
    _fit_exact(keras, {"device_prefetch": 2}, rows, "fit_prefetch", out)
    _resume_exact(keras, {"device_prefetch": 2}, rows)
    out["error_type"] = _item_error(keras, {"device_prefetch": 2})


def main(result_path):
    import keras

    backend = keras.backend.backend()
    out = {"backend": backend}
    (run_jax if backend == "jax" else run_torch)(keras, out)
    out["threads_left"] = _no_prefetch_threads_left()
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
