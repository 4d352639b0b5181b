"""Fingerprints: short digests that identify an order's pass sequence (TF-free).

The lowest module of ``sampling/``: the orders (``order.py``, ``weighted.py``, ``balanced.py``) hash
their arguments here, and the order protocol (``protocol.py``) compares the digests kept in resume states.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

# Names the algorithm that turns (seed, pass, position) into an index (kerasfeed 0.1 drew whole passes
# instead); part of every shuffled or sampled order's fingerprint, so a state saved under another
# algorithm is refused. per-position-2: index spaces of at most 2^16 (a shuffled IndexOrder's items, a
# BalancedOrder's pass and classes) are shuffled by exactly uniform tables.
ORDER_VERSION = "per-position-2"
# per-position-1 used the Feistel network for every size. Orders whose passes did not
# change (WeightedOrder, IndexOrder past 2^16 items) keep it: their states stay valid.
ORDER_VERSION_1 = "per-position-1"


def hash_parts(*parts: Any) -> str:
    """Hex digest of arrays and plain values, for the built-in orders' fingerprints."""
    h = hashlib.sha1()
    for part in parts:
        if isinstance(part, np.ndarray):
            a = np.ascontiguousarray(part)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.data if a.dtype != object else repr(a.tolist()).encode())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def process_shards_fingerprint(order_fp: str, num_shards: int) -> str:
    """The fingerprint of an order (``order_fp``) cut into ``num_shards`` per-process shards
    (``loading/hosts.py``); ``protocol`` computes it too, to name a resume's other shard count."""
    return hash_parts("ProcessShards", order_fp, num_shards)


__all__ = ["ORDER_VERSION", "ORDER_VERSION_1", "hash_parts", "process_shards_fingerprint"]
