"""The workers of a multi-worker cluster check that their pipelines agree.

Every worker of a ``tf.distribute`` cluster builds its own pipeline over its
own shard (``shards.py``). If two workers built theirs from a different
source length, seed, shard count, batching or resume state, shards would
overlap or step counts would differ, silently. So when a sharded pipeline is
created the workers all-gather a few int64s through the cluster's collective
ops: a mismatch fails on every worker with a message naming what differs, and
a worker that never joins fails after ``AGREEMENT_TIMEOUT_S`` instead of
hanging. TensorFlow is imported only when a check runs.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

# Collective group of the agreement check; far above the keys tf.distribute
# allocates for its own groups (they count up from 1).
_GROUP_KEY = 0x6B660000
_instance_keys = itertools.count(1)
_instance_lock = threading.Lock()
AGREEMENT_TIMEOUT_S = 120.0


def _split_seed(seed: Optional[int]) -> tuple[int, int]:
    if seed is None:
        return -1, -1
    return int(seed) >> 32, int(seed) & 0xFFFFFFFF


def fingerprint(**fields: Any) -> dict:
    """``{name: int}``: what every worker's pipeline must agree on.

    ``seed`` is split in two int64s; None values become -1.
    """
    out = {}
    for name, value in fields.items():
        if name == "seed":
            out["seed (high 32 bits)"], out["seed (low 32 bits)"] = _split_seed(value)
        else:
            out[name] = -1 if value is None else int(value)
    return out


def check_agreement(worker: Any, fields: dict, api: str, timeout: Optional[float] = None) -> None:
    """All-gathers ``fields`` over the cluster; raises if workers disagree.

    Every worker must create its sharded pipelines in the same order (each
    creation is one collective instance); whole-source ones (``num_shards=1``)
    are not checked.

    Args:
        worker: this process's ``shards.WorkerIdentity``.
        fields: from ``fingerprint``.
        api: the public function's name, for messages.
        timeout: seconds to wait for the other workers (default
            ``AGREEMENT_TIMEOUT_S``).

    Raises:
        ValueError: some field differs between workers (names the field and
            every worker's value).
        RuntimeError: not every worker created a matching pipeline within
            ``timeout`` seconds, or the exchange failed.
    """
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    timeout = AGREEMENT_TIMEOUT_S if timeout is None else timeout
    names = list(fields)
    values = tf.constant([[fields[n] for n in names]], tf.int64)
    with _instance_lock:
        instance = next(_instance_keys)
    try:
        with tf.device(worker.device):
            gathered = collective_ops.all_gather_v2(
                values, group_size=worker.num_workers, group_key=_GROUP_KEY, instance_key=instance, timeout=timeout
            )
        table = np.asarray(gathered.numpy())
    except tf.errors.OpError as e:  # timed out, or a peer left: never a hang
        raise RuntimeError(
            f"{api}: worker {worker.worker_id} of {worker.num_workers} waited {timeout:.0f} s for the other workers "
            "to create the same pipeline (the check that they agree on source length, seed and shards). Every worker "
            "must create its sharded kerasfeed datasets in the same order; for a dataset on one worker only, pass "
            "`num_shards=1`. "
            f"Received: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None
    if table.shape != (worker.num_workers, len(names)):
        raise RuntimeError(f"{api}: the agreement check got a table of shape {table.shape}. Received: {table!r}")
    differ = [j for j in range(len(names)) if len(set(table[:, j].tolist())) > 1]
    if differ:
        lines = []
        for j in differ:
            per = ", ".join(f"worker {k}: {int(v)}" for k, v in enumerate(table[:, j]))
            lines.append(f"{names[j]} ({per})")
        raise ValueError(
            f"{api}: the workers disagree on {', '.join(names[j] for j in differ)}. Every worker must build its "
            "pipeline from the same source (same length), the same seed, shard count and batching, and resume "
            f"from the same state; otherwise shards overlap or step counts differ. Received: {'; '.join(lines)}"
        )


__all__ = ["AGREEMENT_TIMEOUT_S", "check_agreement", "fingerprint"]
