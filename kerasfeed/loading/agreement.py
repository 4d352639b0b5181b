"""The members of a distributed run check that their pipelines agree: one protocol, a list of facts.

Every ``tf.distribute`` worker (``shards.py``) and every process of a multi-process Keras
distribution (``hosts.py``) builds its own pipeline over its own shard; with another source length,
seed, shard count, batching or resume state, shards would overlap or step counts differ, silently.
So the members all-gather one int64 row of the facts' codes (``check_agreement``) through the
cluster's coordination service (``check_workers``) or JAX (``hosts.exchange``). What a mismatch or a
failed member raises: docs/multiworker.md, *Agreement check and errors*.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

# Collective group of the workers' check; far above the keys tf.distribute
# allocates for its own groups (they count up from 1).
_GROUP_KEY = 0x6B660000
_instance_keys = itertools.count(1)
_instance_lock = threading.Lock()
AGREEMENT_TIMEOUT_S = 120.0
MAX_FACTS = 30  # facts a row holds after its head (failed, the kind: the names checked)
_HEAD = 2


def _code(value: Any) -> int:
    """An int64 for a fact: non-negative ints as themselves, None as -1, anything
    else (a larger int, a fingerprint) as a negative 61-bit hash of its text."""
    if value is None:
        return -1
    if isinstance(value, (bool, int, np.integer)) and 0 <= int(value) < 2**63:
        return int(value)
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return -2 - (int.from_bytes(digest, "big") >> 3)


def _text(code: int) -> str:
    return str(code) if code >= 0 else "None" if code == -1 else f"#{-2 - code:x}"


def _shown(value: Any) -> str:
    """A fact as the table shows it too (a fingerprint's ``#code`` beside it)."""
    code = _code(value)
    return repr(value) if code >= -1 else f"{value!r} ({_text(code)})"


def _kinds(kinds: np.ndarray, mine: int, member: str) -> str:
    """Which members built this member's kind of pipeline (``mine``) and which another."""
    return ", ".join(f"{member} {k}: {'this kind' if v == mine else 'another kind'}"
                     for k, v in enumerate(kinds.tolist()))


def check_agreement(
    names: Sequence[str], facts: Optional[dict], exchange: Callable[[np.ndarray], np.ndarray], *, owner: str,
    me: int, count: int, member: str = "process", group: str = "", shards: Optional[tuple[str, str]] = None,
) -> None:
    """Exchanges this member's ``facts`` (``{name: value}`` over ``names``, in the same order on
    every member; None: its pipeline failed) through ``exchange`` (one int64 row per member into a
    ``(count, len(row))`` table) and compares them. Every member calls it once per pipeline, in the
    same order. ``me``: this member's index; ``member``, ``group``
    (``"of the keras.distribution.DataParallel"``) and ``owner`` are for messages. ``shards``: the names of
    two facts that pair up one to one instead, the data shard a member reads and the shard of a sharded
    ``order=`` it was given (None where it has none): members given the same order shard for other data
    shards would read the same items (``shard_index=0`` left on every process).

    Raises:
        RuntimeError: another member failed to create its pipeline, or the
            exchange returned a table of another shape.
        ValueError: a fact differs between members (names it and every member's value).
    """
    if len(names) > MAX_FACTS:
        raise ValueError(f"{owner}: at most {MAX_FACTS} facts are checked. Received: {len(names)}")
    # One width for every member and kind of pipeline: a member that failed, or built another kind (other
    # facts), still sends a row the others can read.
    row = np.full(_HEAD + MAX_FACTS, -1, np.int64)
    row[0] = facts is None
    row[1] = _code(tuple(names))
    if facts is not None:
        row[_HEAD:_HEAD + len(names)] = [_code(facts[name]) for name in names]
    table = exchange(row)
    if table.shape != (count, len(row)):
        raise RuntimeError(f"{owner}: the agreement check got a table of shape {table.shape}. Received: {table!r}")
    if facts is None:
        return
    plural = member + ("es" if member.endswith("s") else "s")
    failed = [k for k in range(count) if table[k, 0]]
    if failed:
        raise RuntimeError(
            f"{owner}: {member} {failed[0]} of {count} failed to create its pipeline (its own error is in its "
            f"output), so {member} {me} stops here too instead of waiting for it at the first training step. "
            f"Received: failed {plural}={failed}"
        )
    other = [k for k in range(count) if table[k, 1] != row[1]]
    if other:
        raise ValueError(
            f"{owner}: {member} {other[0]} of {count} created another kind of kerasfeed pipeline at this point (one "
            f"whose {plural} check other things than this one's: {', '.join(names)}). Every {member} must create "
            "the same kerasfeed datasets, with the same kind of order (to_dataset, distribute, from_generators, "
            f"an order=...), in the same order. Received: {_kinds(table[:, 1], row[1], member)}"
        )
    paired = [names.index(name) for name in shards or ()]
    differ = [j for j in range(len(names)) if j not in paired and len(set(table[:, _HEAD + j].tolist())) > 1]
    if differ:
        per = "; ".join(
            f"{names[j]} (" + ", ".join(f"{member} {k}: {_text(int(v))}" for k, v in enumerate(table[:, _HEAD + j]))
            + ")"
            for j in differ
        )
        name = names[differ[0]]
        raise ValueError(
            f"{owner}: the {count} {plural} {group + ' ' if group else ''}disagree on "
            f"{', '.join(names[j] for j in differ)}: {per}. Every {member} must build its pipeline from the same "
            "source (same length), with the same shuffle, seed, order, shards, batching and resume state, or the "
            f"shards overlap and the step counts differ. Received: {name}={_shown(facts[name])} on {member} {me}"
        )
    if shards:
        _check_order_shards(table, paired, shards, facts, owner=owner, me=me, member=member, plural=plural)


def _check_order_shards(table: np.ndarray, paired: list, shards: tuple, facts: dict, *, owner: str, me: int,
                        member: str, plural: str) -> None:
    """ValueError unless the members' data shards and order shards pair one to one (see ``check_agreement``)."""
    data, given = (table[:, _HEAD + j].tolist() for j in paired)
    if -1 in given:  # no sharded order (the same on every member: checked with the order's fingerprint)
        return
    if len(set(zip(data, given))) == len(set(data)) == len(set(given)):
        return
    per = ", ".join(f"{member} {k}: {_text(s)}" for k, s in enumerate(given))
    if shards[1] == "shard_index":  # the source's shards, given by hand to each worker
        raise ValueError(
            f"{owner}: the {plural} were given shard_index ({per}): {plural} given the same shard read the same items "
            f"and the other shards are never read. Pass each {member} its own shard_index (here {_text(data[me])}), "
            f"or num_shards alone: each {member} then reads its own. Received: shard_index={facts['shard_index']!r} "
            f"on {member} {me}"
        )
    raise ValueError(
        f"{owner}: the {plural} read the shards of the `order` as {shards[1]} ({per}), but their data shards are "
        f"{', '.join(_text(d) for d in data)}: {plural} reading other data shards must be given other shards of the "
        f"order (or they read the same items), and those reading the same one the same shard. Build the order with "
        f"shard_index=<this {member}'s data shard> (here {_text(data[me])}). "
        f"Received: {shards[1]}={facts[shards[1]]!r} on {member} {me}"
    )


def check_workers(worker: Any, facts: Optional[dict], owner: str, shards: Optional[tuple[str, str]] = None) -> None:
    """``check_agreement`` of this worker (a ``shards.WorkerIdentity``) over its ``tf.distribute``
    cluster (``shards``: as there; ``facts`` None: this worker failed to create its pipeline, and says so);
    RuntimeError also when the other workers did not create a matching pipeline within
    ``AGREEMENT_TIMEOUT_S`` seconds."""
    with _instance_lock:
        instance = next(_instance_keys)

    def exchange(row: np.ndarray) -> np.ndarray:
        import tensorflow as tf
        from tensorflow.python.eager import context

        try:
            if context.context().coordination_service is None:
                return _gather_collective(worker, row, instance)
            return _gather_key_values(worker, row, instance)
        except tf.errors.OpError as e:  # timed out, or a peer left: never a hang
            raise RuntimeError(
                f"{owner}: worker {worker.worker_id} of {worker.num_workers} waited {AGREEMENT_TIMEOUT_S:.0f} s for "
                "the other workers to create the same pipeline (the check that they agree on source length, seed "
                "and shards). Every worker must create its sharded kerasfeed datasets in the same order; for a "
                "dataset on one worker only, pass `num_shards=1`. "
                f"Received: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            ) from None

    check_agreement(
        tuple(facts or ()), facts, exchange, owner=owner, me=worker.worker_id, count=worker.num_workers,
        member="worker", shards=shards,
    )


def _gather_key_values(worker: Any, row: np.ndarray, instance: int) -> np.ndarray:
    """The rows through the coordination service's key-value store, which every
    ``MultiWorkerMirroredStrategy`` cluster runs. Unlike a collective, a wait that
    times out there leaves the worker's collective ops usable (an aborted
    all-gather does not: "Restart your program to reset", and its teardown can
    crash). Each creation's keys are its own: the workers count them alike."""
    from tensorflow.python.eager import context

    ctx = context.context()
    prefix = f"kerasfeed/agreement/{instance}/"
    ctx.set_config_key_value(prefix + str(worker.worker_id), ",".join(map(str, row.tolist())))
    deadline = time.monotonic() + AGREEMENT_TIMEOUT_S
    table = []
    for k in range(worker.num_workers):
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        text = ctx.get_config_key_value(prefix + str(k), wait_ms)
        table.append([int(v) for v in text.split(",")])
    return np.asarray(table, np.int64)


def _gather_collective(worker: Any, row: np.ndarray, instance: int) -> np.ndarray:
    """The rows through an all-gather, for a cluster without a coordination service."""
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    with tf.device(worker.device):
        gathered = collective_ops.all_gather_v2(
            tf.constant([row], tf.int64), group_size=worker.num_workers, group_key=_GROUP_KEY,
            instance_key=instance, timeout=AGREEMENT_TIMEOUT_S,
        )
    return np.asarray(gathered.numpy())


__all__ = ["AGREEMENT_TIMEOUT_S", "check_agreement", "check_workers"]
