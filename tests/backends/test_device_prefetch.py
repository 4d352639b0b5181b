"""to_loader(..., device_prefetch=N): batches placed ahead of the step (kerasfeed/loader/device.py).

``device_scenario.py`` runs ``fit`` under JAX (two CPU devices, with and
without Keras' DataParallel, and with an emulated accelerator) and PyTorch
in their own processes; the tests here check the loader side in this one.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _util import keras_reset
from test_backends import REPO, _notf_python

import kerasfeed

HERE = Path(__file__).resolve().parent


class Items(kerasfeed.SceneSequence):
    def __init__(self, n=10, bad=None):
        super().__init__()
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"no item {i}")
        return np.full((2,), i, "int64"), np.float32(self.epoch)


def _prefetch_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "kerasfeed-device-prefetch"]


def _wait_no_prefetch_threads(timeout_s: float = 5.0) -> list:
    deadline = time.monotonic() + timeout_s
    while _prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return _prefetch_threads()


def _run(python: str, backend: str, tmp_path: Path, **env_extra) -> dict:
    result = tmp_path / f"device-{backend}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH", "XLA_"))}
    env.update(KERAS_BACKEND=backend, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", **env_extra)
    proc = subprocess.run(
        [python, str(HERE / "device_scenario.py"), str(result)], check=False, capture_output=True, text=True, env=env,
        timeout=240,
    )
    assert proc.returncode == 0, f"{backend} device scenario failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(result.read_text())


def test_jax_fit_on_two_devices_with_prefetch(tmp_path):
    """JAX on two CPU devices: placed batches are jax.Arrays on the default device or with
    DataParallel's data sharding, the same values in the same order, handed back unchanged by
    Keras' own placement; fit and resume train exactly; Keras' build (one batch, two read on an
    accelerator, plus the prefetch) consumes no pass; item errors name the index; batches the two
    devices cannot split are refused before the first step (items of varying sizes as each is read),
    and the model trains on."""
    out = _run(_notf_python(), "jax", tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    epochs = 2 * 8
    assert out == {
        "backend": "jax",
        "fit_prefetch": {"prefetch": 2, "batches": 1 + epochs},  # the build's batch, then two passes
        "fit_accelerator_default": {"prefetch": 2, "batches": 2 + epochs},  # Keras read one ahead
        "fit_accelerator_no_prefetch": {"prefetch": 0, "batches": 0},
        "sharded_target": "DataParallel data layout",
        "fit_data_parallel": {"prefetch": 2, "batches": 1 + epochs},  # Keras builds its metrics from one batch
        "indivisible": [  # made under DataParallel (two), then made before it and fitted under it
            "`batch_size` is split among the 2 devices on the batch axis 'batch' of the "
            "keras.distribution.DataParallel: 3 samples do not divide among 2 devices",
            "the last batch of every pass has 1 samples, which do not divide among the 2 devices on the batch "
            "axis 'batch' of the keras.distribution.DataParallel",
            "the last batch of every pass has 1 samples, which do not divide among the 2 devices on the batch "
            "axis 'batch' of the keras.distribution.DataParallel",
            "item 3 is a batch of 3 samples, which do not divide among the 2 devices on the batch axis 'batch' "
            "of the keras.distribution.DataParallel",
        ],
        "error_type": "ItemError",
        "threads_left": [],
    }


def test_torch_fit_with_prefetch(tmp_path):
    """PyTorch: prefetched tensors (on the CPU here) carry the same values in order; fit and
    resume train exactly; the default on a CPU shares the numpy memory without a thread."""
    out = _run(sys.executable, "torch", tmp_path)
    assert out == {"backend": "torch", "fit_prefetch": {"prefetch": 2, "batches": 17}, "error_type": "ItemError",
                   "threads_left": []}


def test_device_prefetch_is_checked_up_front():
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match=rf"to_loader: `device_prefetch` must be a non-negative int\. Received: device_prefetch={bad!r}"):
            kerasfeed.to_loader(Items(), device_prefetch=bad)


@pytest.mark.parametrize("depth", [0, 2])
def test_a_device_jax_or_torch_cannot_use_is_refused_naming_it(depth):
    """Before: loader.jax("cpu") yielded numpy arrays without a word (JAX's ValueError was taken for a Keras batch
    a mesh cannot split), and loader.torch("cuda") on a CPU-only torch raised torch's "torch.cuda.Stream requires
    CUDA support" from the prefetch's set-up."""
    import jax

    with kerasfeed.to_loader(Items(), device_prefetch=depth) as loader:
        for bad in ("cpu", 3):
            with pytest.raises(ValueError, match=r"^loader.jax: `device` must be a jax.Device or a jax.sharding."
                                                 rf"Sharding .*Received: device={bad!r}$"):
                next(iter(loader.jax(bad)))
        assert all(isinstance(x, jax.Array) for x, _ in loader.jax(jax.devices("cpu")[0]))
        import torch

        if not torch.cuda.is_available():  # the suite's machines (CI: no GPU)
            with pytest.raises(ValueError, match=r"^loader.torch: `device` is a CUDA device, and this torch has none"):
                next(iter(loader.torch("cuda")))
        with pytest.raises(ValueError, match=r"^loader.torch: `device` must be a torch device .*Received: "
                                             r"device='bogus'$"):
            next(iter(loader.torch("bogus")))


def test_jax_prefetch_yields_the_numpy_batches_in_order_and_stops_its_thread():
    import jax

    with kerasfeed.to_loader(Items(), shuffle=True, seed=2, device_prefetch=3) as loader, \
            kerasfeed.to_loader(Items(), shuffle=True, seed=2, device_prefetch=0) as plain:
        for _ in range(2):
            got, want = list(loader.jax()), list(plain.jax())
            assert all(isinstance(x, jax.Array) for x, _ in got)
            assert [(np.asarray(x).tolist(), float(y)) for x, y in got] == [(x.tolist(), float(y)) for x, y in want]
        it = loader.jax()
        next(it)
        assert len(_prefetch_threads()) == 1
        del it  # dropped half-way (Keras drops its iterator every epoch)
        assert _wait_no_prefetch_threads() == []
        device = kerasfeed.stats(loader)["device"]
    assert device["prefetch"] == 3 and device["batches"] == 21 and 0 <= device["ready_fraction"] <= 1
    assert device["wait_ms"]["max"] >= device["wait_ms"]["p50"] >= 0 and device["place_ms"]["p50"] > 0


def test_a_build_that_read_ahead_is_replayed_in_full():
    """Keras' build on an accelerator reads two batches (one ahead) and the prefetch thread up
    to depth + 1 more: after Keras' reset the next iterator yields the whole pass from its start."""
    with kerasfeed.to_loader(Items(), shuffle=True, seed=0, device_prefetch=2) as loader:
        build = loader.get_jax_iterator()
        next(build), next(build)
        time.sleep(0.2)  # let the thread read ahead
        del build
        keras_reset(loader)  # Keras' EpochIterator.reset()
        pass0 = [int(x[0]) for x, _ in loader.get_jax_iterator()]
        pass1 = [int(x[0]) for x, _ in loader.get_jax_iterator()]
    order = kerasfeed.IndexOrder(10, True, 0)
    assert pass0 == order.indices(0).tolist() and pass1 == order.indices(1).tolist()
    assert _wait_no_prefetch_threads() == []


def test_a_prefetch_thread_reading_after_the_build_s_reset_does_not_cancel_the_hand_over(monkeypatch):
    """Under load the prefetch thread of the build's iterator may call ``next`` again after Keras'
    reset: that is not Keras going on with the build's iterator, so the next iterator still takes the
    pass over (seen as pass 0 begun twice in fit, 2 of 6 runs beside CPU burners, before the fix)."""
    from kerasfeed.loader import device

    real, gate, placed = device._jax_place, threading.Event(), []

    def gated(*args, **kwargs):
        place, target = real(*args, **kwargs)

        def slow(batch):
            placed.append(1)
            if len(placed) == 3:  # the thread is placing batch 3 while Keras resets
                assert gate.wait(10)
            return place(batch)

        return slow, target

    monkeypatch.setattr(device, "_jax_place", gated)
    with kerasfeed.to_loader(Items(), shuffle=True, seed=0, device_prefetch=2) as loader:
        build = loader.get_jax_iterator()
        next(build), next(build)
        keras_reset(loader)  # Keras' EpochIterator.reset(), the build's iterator still held
        gate.set()
        deadline = time.monotonic() + 5
        while len(placed) < 4 and time.monotonic() < deadline:  # the thread calls next() again
            time.sleep(0.01)
        assert len(placed) >= 4
        pass0 = [int(x[0]) for x, _ in loader.get_jax_iterator()]
        del build
        pass1 = [int(x[0]) for x, _ in loader.get_jax_iterator()]
    order = kerasfeed.IndexOrder(10, True, 0)
    assert pass0 == order.indices(0).tolist() and pass1 == order.indices(1).tolist()
    assert _wait_no_prefetch_threads() == []


def test_an_item_error_reaches_the_consumer_at_its_place():
    with kerasfeed.to_loader(Items(bad=4), device_prefetch=2) as loader:
        it = loader.jax()
        assert [int(next(it)[0][0]) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(kerasfeed.ItemError, match=r"Items\[4\] raised KeyError"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_torch_host_copy_is_a_copy_with_from_numpy_s_dtype_for_any_layout():
    # The CUDA path's staging copy (pinned there; pin=False is the same numpy fill on a CPU).
    import torch  # in the dev extra

    from kerasfeed.loader.device import host_copy

    rng = np.random.default_rng(0)
    frozen = rng.random((3, 4)).astype("float32")
    frozen.flags.writeable = False
    cases = [rng.integers(0, 255, (2, 5, 5, 3), dtype="uint8"), frozen,
             rng.random((4, 6))[:, ::2], np.array([True, False]), np.float64(2.5) * np.ones(())]
    for a in cases:
        t = host_copy(torch, a, pin=False)
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(t.shape) == a.shape
        np.testing.assert_array_equal(t.numpy(), a)
        assert not np.shares_memory(t.numpy(), a)
    with pytest.raises(TypeError):
        host_copy(torch, np.array(["a"], dtype="U1"), pin=False)


def test_bfloat16_batches_become_torch_bfloat16_tensors():
    # torch.from_numpy has no ml_dtypes bfloat16: the loader's torch batches raised a bare TypeError.
    import ml_dtypes
    import torch

    from kerasfeed.loader.convert import from_numpy, torch_dtype
    from kerasfeed.loader.device import host_copy

    a = (np.arange(12, dtype=np.float32).reshape(3, 4) / 4).astype(ml_dtypes.bfloat16)
    view = from_numpy(torch, a)
    assert view.dtype == torch.bfloat16 and view.data_ptr() == a.ctypes.data  # no copy
    strided = a[:, ::2]
    for t in (view, host_copy(torch, a, pin=False), host_copy(torch, strided, pin=False)):
        assert t.dtype == torch.bfloat16
    np.testing.assert_array_equal(host_copy(torch, strided, pin=False).float().numpy(), strided.astype(np.float32))
    np.testing.assert_array_equal(view.float().numpy(), a.astype(np.float32))
    with pytest.raises(TypeError, match=r"dtype float8_e4m3fn, which torch has no tensor for.*Received: dtype=float8_e4m3fn"):
        torch_dtype(torch, np.dtype(ml_dtypes.float8_e4m3fn))

    class Half(kerasfeed.SceneSequence):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.full((2, 2), i + 0.5, ml_dtypes.bfloat16), np.int64(i)

    with kerasfeed.to_loader(Half(), batch_size=3) as loader:
        (x, y), = list(loader.torch())
    assert x.dtype == torch.bfloat16 and x.float()[:, 0, 0].tolist() == [0.5, 1.5, 2.5] and y.tolist() == [0, 1, 2]
