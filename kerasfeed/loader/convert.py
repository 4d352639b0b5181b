"""A loader's numpy batches as torch tensors (what Keras' PyTorch trainer drains)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np


def map_arrays(fn: Callable[[np.ndarray], Any], batch: Any) -> Any:
    """Applies ``fn`` to every array of a batch (tuples and dicts, as the loader yields them)."""
    if isinstance(batch, dict):
        return {k: map_arrays(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(map_arrays(fn, v) for v in batch)
    return fn(batch)


def torch_dtype(torch: Any, dtype: np.dtype) -> tuple[Any, np.dtype]:
    """``(torch dtype, numpy dtype of the same bytes that torch.from_numpy takes)``.

    ``torch.from_numpy`` has no bfloat16 (ml_dtypes', what JAX and Keras
    give numpy): its bytes go through int16 and are viewed back, no copy.

    Raises:
        TypeError: torch has no tensor of ``dtype``, naming it.
    """
    if dtype.name == "bfloat16":
        return torch.bfloat16, np.dtype(np.int16)
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype, dtype
    except TypeError:
        raise TypeError(
            f"kerasfeed: a batch has an array of dtype {dtype.name}, which torch has no tensor for: convert it in "
            f"`__getitem__` (e.g. to float32). Received: dtype={dtype.name}"
        ) from None


def from_numpy(torch: Any, a: np.ndarray) -> Any:
    """``torch.from_numpy(a)`` for any dtype torch holds (bfloat16 included): a view, no copy."""
    dtype, view = torch_dtype(torch, a.dtype)
    t = torch.from_numpy(a if view == a.dtype else a.view(view))
    return t if t.dtype == dtype else t.view(dtype)


def cpu_tensor(torch: Any, a: np.ndarray) -> Any:
    """``a`` as a CPU tensor sharing its memory (copied first if read-only or with a negative stride: a
    ``np.flip`` the source returned); strings stay numpy."""
    if a.dtype == object:
        return a  # strings: torch has no such tensor
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = a.copy()  # torch.from_numpy needs writable memory and strides it can hold
    return from_numpy(torch, a)


class TorchBatches:
    """A loader's batches as torch tensors; ``iter()`` reads one pass.

    What Keras' PyTorch trainer iterates; usable in a custom torch loop like
    a ``torch.utils.data.DataLoader`` (``len()`` is the number of batches).
    """

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        import torch

        for batch in self.loader:
            yield map_arrays(lambda a: cpu_tensor(torch, a), batch)

    def __len__(self) -> int:
        return self.loader.num_batches


__all__ = ["TorchBatches", "cpu_tensor", "from_numpy", "map_arrays", "torch_dtype"]
