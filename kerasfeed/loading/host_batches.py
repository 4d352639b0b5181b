"""Batches a multi-device distribution can split: the per-process batch must
divide among this process's devices on the batch axis (TF-free).

``jax.make_array_from_process_local_data`` (and, in one process, the data
layout of ``DataParallel``) splits every batch among the devices; one that
does not divide fails inside the step, after the batches before it trained.
The front end checks the batching when it is made, and items that are whole
batches as each is read. Under several processes reading their own shards
those must also all be of one size (``EqualItemBatches``): a step joins every
process's batch, and a short one on one process beside a full one elsewhere
makes a wrong global batch (JAX does not refuse it). ``hosts.py`` decides the shards.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from kerasfeed._nest import flatten
from kerasfeed.errors import SignatureError
from kerasfeed.loading.hosts import ProcessShards


def check_local_batches(
    processes: ProcessShards, *, batch_size: Optional[int], partial: Optional[int], leading: list, owner: str
) -> None:
    """Refuses a per-process batch that does not divide among this process's
    devices on the batch axis (the step would fail: at the first, or for a
    short last batch after the rest of the pass trained). Also for a
    distribution in one process (``local_distribution``).

    Args:
        batch_size: the per-process batch (None: items are batches).
        partial: samples in a pass's short last batch, or None.
        leading: with ``batch_size=None``, the leading sizes of the probed
            items' arrays (None where they vary).
    """
    devices = processes.local_batch_shards
    if devices <= 1:
        return
    alone, where = processes.num_processes == 1, _devices_text(processes)
    if batch_size is not None and batch_size % devices:
        what = "is split among" if alone else "is the per-process batch, split again among"
        total = "" if alone else f" (the global batch is batch_size x {processes.num_shards} shards)"
        raise ValueError(
            f"{owner}: `batch_size` {what} {where}: {batch_size} samples do not divide among {devices} devices. "
            f"Use a multiple of {devices}{total}. Received: batch_size={batch_size}"
        )
    if batch_size is not None and partial and partial % devices:
        raise ValueError(
            f"{owner}: the last batch of every pass has {partial} samples, which do not divide among {where}. "
            f"Pass `drop_remainder=True`, or give {'the pass' if alone else 'every process'} a multiple of "
            f"{devices} items{'' if alone else ' per pass'}. "
            f"Received: batch_size={batch_size}, drop_remainder=False, last batch={partial}"
        )
    bad = [d for d in leading if d is not None and d % devices]
    if batch_size is None and bad:
        raise ValueError(
            f"{owner}: items are whole batches (batch_size=None) of {bad[0]} samples, which do not divide among "
            f"{where}. Return batches of a multiple of {devices} samples. Received: item batch size={bad[0]}"
        )


def _devices_text(processes: ProcessShards) -> str:
    on = "" if processes.num_processes == 1 else f" of process {processes.process_index}"
    return (
        f"the {processes.local_batch_shards} devices{on} on the batch axis {processes.batch_axis!r} "
        f"of the {processes.source}"
    )


def item_batch_check(processes: Optional[ProcessShards], owner: str) -> Optional[Callable[[Any, list], None]]:
    """With items that are whole batches of sizes that vary, ``check(index, arrays)``
    of each item as it is read: refuses one whose leading size does not divide
    among this process's devices. None: nothing to check."""
    if processes is None or processes.local_batch_shards <= 1:
        return None
    devices = processes.local_batch_shards

    def check(index: Any, arrays: list) -> None:
        for a in arrays:
            if getattr(a, "ndim", 0) and a.shape[0] % devices:
                raise ValueError(
                    f"{owner}: item {index} is a batch of {a.shape[0]} samples, which do not divide among "
                    f"{_devices_text(processes)}. Return batches of a multiple of {devices} samples. "
                    f"Received: item batch size={a.shape[0]}"
                )

    return check


def _leading_sizes(item: Any) -> Optional[tuple]:
    """The leading size of each leaf of an item (None for a 0-d leaf), or
    None when the item cannot be read so (its own check reports it)."""
    try:
        return tuple((np.shape(leaf) or (None,))[0] for _, leaf in flatten(item)[1])
    except Exception:  # noqa: BLE001 - the signature check names what is wrong
        return None


def _one_size(sizes: tuple) -> Any:
    """The one leading size of an item's leaves (0-d leaves aside), else the sizes per leaf."""
    known = {d for d in sizes if d is not None}
    return next(iter(known)) if len(known) == 1 else sizes


def _unequal(owner: str, index: Any, got: tuple, expected: tuple, probed: Any, why: str) -> ValueError:
    size, want = _one_size(got), _one_size(expected)
    return ValueError(
        f"{owner}: item {index} is a batch of {size} samples, but the probed items are batches of {want} "
        f"(item {probed}). Under {why}, a step joins every process's batch of that step "
        "(jax.make_array_from_process_local_data), so with batch_size=None every item must have the same leading "
        "size on every process: a short item on one process while another has a full one makes a wrong global "
        f"batch. Return batches of {want} samples (drop or pad the short last one), or return samples and pass "
        f"`batch_size` (with `drop_remainder=True` or a pass that divides). Received: item {index} batch size={size}, "
        f"expected {want}"
    )


def equal_probed_batches(probes: list, why: str, owner: str) -> Optional[tuple]:
    """The leading sizes (per leaf) that every item must have, from the probed
    ``[(index, item), ...]`` (which include the source's last item, where a
    short batch usually is). None when the probes cannot be read.

    Raises:
        ValueError: probed items of different leading sizes.
    """
    expected = first = None
    for index, item in probes:
        sizes = _leading_sizes(item)
        if sizes is None:
            return None
        if expected is None:
            expected, first = sizes, index
        elif sizes != expected:
            raise _unequal(owner, index, sizes, expected, first, why)
    return expected


class EqualItemBatches:
    """An item checker (``flat_arrays``, as the pipeline calls it) that
    refuses items whose leading sizes differ from the probed ones, by name,
    before the signature's generic message (``equal_probed_batches``)."""

    def __init__(self, checker: Any, expected: tuple, probed: Any, why: str, owner: str):
        self._checker, self.expected, self._probed, self._why, self._owner = checker, expected, probed, why, owner

    def _check(self, index: Any, sizes: Optional[tuple]) -> None:
        if sizes is not None and len(sizes) == len(self.expected) and sizes != self.expected:
            raise _unequal(self._owner, index, sizes, self.expected, self._probed, self._why)

    def flat_arrays(self, index: Any, item: Any) -> list:
        try:
            arrays = self._checker.flat_arrays(index, item)
        except SignatureError:
            self._check(index, _leading_sizes(item))
            raise
        self._check(index, tuple(a.shape[0] if getattr(a, "ndim", 0) else None for a in arrays))
        return arrays


def item_batch_fact(expected: Optional[tuple]) -> Any:
    """What the processes exchange for ``hosts.FACTS``' "item batch size":
    the one leading size of the items, or their sizes per leaf."""
    return None if expected is None else _one_size(expected)


__all__ = ["EqualItemBatches", "check_local_batches", "equal_probed_batches", "item_batch_check", "item_batch_fact"]
