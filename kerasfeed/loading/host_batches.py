"""Batches a multi-device distribution can split: the per-process batch must
divide among this process's devices on the batch axis (TF-free).

``jax.make_array_from_process_local_data`` (and, in one process, the data
layout of ``DataParallel``) splits every batch among the devices; one that
does not divide fails inside the step, after the batches before it trained.
The front end checks the batching when it is made, and items that are whole
batches of sizes that vary as each is read. ``hosts.py`` decides the shards.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kerasfeed.loading.hosts import ProcessShards


def check_local_batches(
    processes: ProcessShards,
    *,
    batch_size: Optional[int],
    partial: Optional[int],
    leading: list,
    owner: str,
) -> None:
    """Refuses a per-process batch that does not divide among this process's
    devices on the batch axis (``jax.make_array_from_process_local_data``
    would fail in the step: at the first, or for a short last batch after
    the rest of the pass trained). Also for a distribution in one process
    (``local_distribution``).

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
    """With items that are whole batches of sizes that vary, a check of each
    item's arrays as it is read: ``check(index, arrays)`` refuses one whose
    leading size does not divide among this process's devices (JAX's would
    fail mid-pass, after the batches before it trained). None: nothing to check."""
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


__all__ = ["check_local_batches", "item_batch_check"]
