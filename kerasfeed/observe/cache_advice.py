"""Whether ``cache=`` would pay for a source, and which kind (``kerasfeed.profile``'s ``cache`` line; TF-free).

The stage ``cache=`` stores is timed and sized alone where it is ``load(i)`` (``probe_load``), and set against
the item's own probe: a cache skips only that stage's time, holds its output, and reads it back at about a
copy (``cache_advice``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from kerasfeed.cache.keys import stage_of

LOAD_SHARE = 0.5  # load(i) under this share of an item's time: a cache skips too little of it
# cache= pays when making an item costs this many times reading it back (about one copy of its bytes).
CACHE_GAIN = 5.0


def probe_load(source: Any, n: int, calls: int = 3) -> Any:
    """The stage ``cache=`` stores, run as the cache runs it (``run_stage``: ``load(i)``, or ``__getitem__``
    without one): on a source whose items are ``augment(load(i))``, ``load`` timed alone (after
    ``probe_source``'s warm-up) and its output sized; None for ``__getitem__`` (the item's own probe serves).
    ``refused``: the cache's error when the stage reads what depends on the pass (``item_rng()``, ``epoch``)."""
    import statistics
    from types import SimpleNamespace

    from kerasfeed.execution.auto_probe import copy_time, item_arrays
    from kerasfeed.execution.cached_items import run_stage
    from kerasfeed.sources.item_random import item_scope

    name, walls = stage_of(source), []
    try:
        for i in range(1, calls + 1):
            with item_scope(i % n):
                t0 = time.perf_counter()
                stored = run_stage(source, name, i % n)
                walls.append(time.perf_counter() - t0)
    except RuntimeError as e:
        if "the stage that cache= stores" not in str(e):
            raise
        return SimpleNamespace(refused=str(e).split(" was used inside ")[0], stage=name)
    if name != "load":
        return None
    arrays = item_arrays(stored)
    # The faster of two copies: the first one's page faults are not a store's read.
    return SimpleNamespace(wall_s=statistics.median(walls), copy_s=copy_time(arrays, tries=2),
                           nbytes=int(sum(a.nbytes for a in arrays)), refused=None)


def cache_advice(probe: Any, n: int, source: Any, memory: Optional[int] = None,
                 disk: Optional[int] = None, stored: Any = None) -> str:
    """Whether ``cache=`` would pay for a source of ``n`` items like ``probe``, and which kind.

    Args:
        stored: where the cache stores ``load(i)`` (not the item), that stage's probe
            (``wall_s``, ``copy_s``, ``nbytes``): a cache skips only its time and holds its output;
            with ``refused``, the stored stage reads what depends on the pass (the cache would refuse it).
        memory, disk: bytes a store could take in RAM / on local disk (None:
            ``Cache``'s defaults: half the available memory, half the free disk
            of the working directory).
    """
    import shutil

    from kerasfeed.cache.options import DISK_SHARE, MEMORY_SHARE, available_memory

    if stored is not None and getattr(stored, "refused", None):
        return (f"not as it stands: {stored.stage} uses {stored.refused}, which depends on the pass, and cache= "
                f"stores {stored.stage}: move that into augment(item) (run every pass after the cache)"
                + ("" if stored.stage == "load" else ", after a load(i) that is stored"))
    if stored is not None:
        if stored.wall_s < LOAD_SHARE * probe.wall_s:
            return (f"not worth it: load(i) takes {stored.wall_s * 1e3:.2f} ms of an item's "
                    f"{probe.wall_s * 1e3:.2f} ms; the rest, augment(item), runs every pass with a cache too")
        probe = stored  # its time is what is skipped, its output what is held
    make_ms, read_ms = probe.wall_s * 1e3, max(probe.copy_s, 1e-6) * 1e3
    # By the times alone: a large item (transport-bound) costly to make is stored once and read back at a copy.
    if probe.wall_s < CACHE_GAIN * max(probe.copy_s, 1e-6):
        return (f"not worth it: an item costs {make_ms:.2f} ms to make and about {read_ms:.2f} ms to read back "
                "(its copy): making it is as cheap as storing it")
    if memory is None:
        memory = int(available_memory() * MEMORY_SHARE)  # the cache's own default budget (container-aware)
    if disk is None:
        disk = int(shutil.disk_usage(".").free * DISK_SHARE)
    total = probe.nbytes * n
    split = ("" if callable(getattr(source, "load", None)) else
             "; random augmentation belongs in augment(item), after a load(i) that is stored")
    gain = f"items cost {make_ms:.2f} ms to make and ~{read_ms:.2f} ms to read back"
    if total <= memory:
        return f"cache='memory' ({total / 2**30:.2f} GB for {n} items fits in RAM): {gain}{split}"
    if total <= disk:
        return (f"cache='<a local directory>' ({total / 2**30:.2f} GB for {n} items: more than half the memory, "
                f"fits on disk, and a kept directory serves the next run too): {gain}{split}")
    share = max(memory, disk) / max(total, 1)
    return (f"kerasfeed.Cache(max_bytes=...): all {n} items take {total / 2**30:.1f} GB, more than memory or disk "
            f"can hold; a budget stores the first {share:.0%} and makes the rest every pass: {gain}{split}")


__all__ = ["CACHE_GAIN", "LOAD_SHARE", "cache_advice", "probe_load"]
