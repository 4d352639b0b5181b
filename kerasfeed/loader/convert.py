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


class TorchBatches:
    """A loader's batches as torch tensors; ``iter()`` reads one pass.

    What Keras' PyTorch trainer iterates; usable in a custom torch loop like
    a ``torch.utils.data.DataLoader`` (``len()`` is the number of batches).
    """

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        import torch

        def to_tensor(a: np.ndarray) -> Any:
            if a.dtype == object:
                return a  # strings: torch has no such tensor
            if not a.flags.writeable:
                a = a.copy()  # torch.from_numpy needs writable memory
            return torch.from_numpy(a)

        for batch in self.loader:
            yield map_arrays(to_tensor, batch)

    def __len__(self) -> int:
        return self.loader.num_batches


__all__ = ["TorchBatches", "map_arrays"]
