"""``H5RowSequence``: batches made of the rows an order picks (balanced, weighted...)."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kerasfeed.hdf5.base import H5Base
from kerasfeed.hdf5.keys import KeysLike, PathsLike
from kerasfeed.hdf5.options import H5Keywords
from kerasfeed.remote.chunks import concat
from kerasfeed.sampling.order import IndexOrder
from kerasfeed.sampling.protocol import order_shards, resolve_order
from kerasfeed.sampling.views import pass_view

if TYPE_CHECKING:
    from typing_extensions import Unpack


class H5RowSequence(H5Base):
    """Batches of HDF5 rows in the sequence an order picks them, pass after pass.

    Pass ``epoch`` reads rows ``order.indices(epoch)`` (global row numbers over all files, concatenated
    as for ``H5SliceSequence``), cut into batches of ``batch_size``: with a ``BalancedOrder`` every batch
    is made of class-balanced rows, and only the rows delivered are ever read. The pass is
    ``self.epoch``: ``to_dataset`` sets it in every process, ``model.fit(seq)`` advances it at every
    epoch end.

    What it costs: a batch's rows are read sorted and without repeats (a repeated row is read once and
    copied), one slice per run of consecutive rows, per file and key. Scattered rows of a chunked,
    compressed file cost a chunk read and decompression per distinct chunk touched, where a contiguous
    slice reads ``batch_size / chunk`` chunks. Measured roughly on a busy 2-core machine (gzip chunks of
    8 scenes x 1024 points x 6 float32, batches of 32 out of 1024 scenes, 4 classes): about 8x the time
    of a contiguous slice with h5py's default 1 MB chunk cache, about 4-5x once a chunk cache that holds
    the dataset is warm (``open_kwargs={"rdcc_nbytes": 64 << 20, "rdcc_nslots": 10007}``): one read call
    per row remains. Keep rows in small chunks (a few rows each) or uncompressed for sampled reads, and
    read on worker processes (``executor="processes"``): h5py serialises reads within a process.

    Args:
        paths: one HDF5 file or a sequence of files.
        keys: dataset names (a name, tuple/list, dict, or a nest of them), as for ``H5SliceSequence``.
        batch_size: rows per batch.
        order: the row order of every pass: ``kerasfeed.BalancedOrder`` (e.g.
            ``BalancedOrder.from_hdf5(paths, "labels", seed=0)``), ``WeightedOrder``, ``IndexOrder`` or any
            object with ``shard_length`` and ``indices(epoch)``, over exactly ``num_rows`` items. Its
            shards are this sequence's shards.
        drop_remainder: drop the last batch of a pass if it is short.
        transform: optional ``transform(batch, rng) -> batch``; ``rng`` is seeded by ``(seed, epoch, index)``.
        seed: seed of ``transform``'s generator; defaults to the order's ``seed`` (or 0).
        swmr, open_kwargs, workers, use_multiprocessing, max_queue_size: as for ``H5SliceSequence``.

    Raises:
        ValueError: the order does not pick from exactly ``num_rows`` rows (e.g. labels of another file),
            or bad files, keys or arguments.

    Example:

    ```python
    import kerasfeed
    from kerasfeed.datasets import make_synthetic_scenes

    path = make_synthetic_scenes("/tmp/scenes.h5", num_scenes=256)
    order = kerasfeed.BalancedOrder.from_hdf5(path, "labels", seed=0)
    seq = kerasfeed.H5RowSequence(path, ("points", "labels"), 32, order=order)
    x, y = seq[0]                                  # 32 balanced rows
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=2)
    ```
    """

    _REFUSED = {"shuffle": "the order picks the rows of every pass (seed the order to shuffle them)"}

    def __init__(
        self,
        paths: PathsLike,
        keys: KeysLike,
        batch_size: int,
        *,
        order: Any,
        **options: Unpack[H5Keywords],
    ):
        if options.get("seed") is None:
            seed = getattr(order, "seed", None)
            options["seed"] = int(seed) if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) else 0
        super().__init__(paths, keys, batch_size, **options)
        cls = type(self).__name__
        if order is None:
            raise TypeError(
                f"{cls}: `order` is required (e.g. kerasfeed.BalancedOrder.from_hdf5(paths, 'labels')). "
                "Received: order=None"
            )
        try:
            self.order = resolve_order(self.num_rows, order)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{cls}: {e} (the files hold {self.num_rows} rows)") from e
        given = getattr(self.order, "order", self.order)  # resolve_order wraps a given order to check it
        self._per_pass = not (isinstance(given, IndexOrder) and not given.shuffle)
        n = self.order.shard_length
        self._len = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        if self._len == 0:
            raise ValueError(
                f"{cls}: no batches: a pass has {n} rows, fewer than batch_size={self.batch_size} with "
                f"drop_remainder=True. Received: order={order!r}"
            )

    def __len__(self) -> int:
        return self._len

    def kerasfeed_unshardable(self) -> Optional[str]:
        """An order that is one shard already: its batches are this worker's (``sources.base``)."""
        order = getattr(self.order, "order", self.order)  # resolve_order wraps a given order to check it
        if order_shards(order) > 1:
            return ("its order is one shard already, so its batches are this worker's rows and cutting them "
                    "again leaves rows unread. Pass num_shards=1 to read this sequence whole here, or build the "
                    f"order without num_shards and let the pipelines shard its batches. Received: order={order!r}")
        if getattr(order, "seed_drawn", False) and getattr(order, "shuffle", True):
            return ("its order drew a seed of its own (seed=None), and an order made in each worker's process draws "
                    "another: their batches would hold overlapping rows. Pass the same seed= to the order on every "
                    f"worker. Received: order={order!r}")
        return None

    def kerasfeed_settings(self) -> dict:
        """The base's, plus which rows the order puts in each batch (cache keys): an order is no dataclass
        once ``resolve_order`` wraps it, so it was left out, and shard 1 of an ``IndexOrder`` was served
        shard 0's stored batches. Its pass 0 as a digest (a per-pass order is refused by ``cache=`` anyway)."""
        rows = np.ascontiguousarray(np.asarray(pass_view(self.order, 0).window(0, self.order.shard_length)),
                                    dtype=np.int64)
        return {**super().kerasfeed_settings(), "order_rows": hashlib.sha256(rows.tobytes()).hexdigest()[:32]}

    def batch_rows(self, index: int) -> np.ndarray:
        """The global row numbers that batch ``index`` of this pass holds, in order."""
        i = self._check_index(index)
        cached = getattr(self, "_pass_cache", None)
        epoch = self.epoch if self._per_pass else 0  # an unshuffled order: the same every pass (cache= may store it)
        if cached is None or cached[0] != epoch:
            cached = (epoch, pass_view(self.order, epoch))  # lazy: a window of the pass at a time
            self._pass_cache = cached  # one tuple: safe to swap under threads
        return cached[1].window(i * self.batch_size, (i + 1) * self.batch_size)

    def __getitem__(self, index: int) -> Any:
        rows = self.batch_rows(index)
        unique, inverse = np.unique(rows, return_inverse=True)  # sorted: what HDF5 selections need
        offsets = self._row_offsets
        cuts = np.searchsorted(unique, offsets[1:-1])
        # (file, its rows as runs) of every file the batch touches.
        files = [(f, _runs(part - offsets[f])) for f, part in enumerate(np.split(unique, cuts)) if len(part)]
        reads = self._read_keys(files, local=self._read_runs)
        arrays = {key: concat(parts)[inverse.reshape(-1)] for key, parts in reads.items()}
        return self._finish(self._check_index(index), arrays)

    def _read_runs(self, file_index: int, key: str, runs: list) -> np.ndarray:
        n, first, stop = sum(b - a for a, b in runs), runs[0][0], runs[-1][1]
        # One slice per run: h5py's fast path (a point selection of scattered rows measured slower).
        return self._read_local(file_index, key, f"{n} rows ({first}..{stop - 1})", stop, n,
                                lambda ds: concat([ds[a:b] for a, b in runs]))

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_pass_cache", None)
        return state


def _runs(rows: np.ndarray) -> list:
    """Sorted row numbers as runs of consecutive rows: ``[(first, stop), ...]``."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts)]


__all__ = ["H5RowSequence"]
