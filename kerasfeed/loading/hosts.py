"""Which shard of every pass this process reads under a multi-process Keras distribution.

Keras 3's multi-host ``model.fit`` (``keras.distribution`` on JAX, one process per host) joins the
processes' batches into each global batch (``jax.make_array_from_process_local_data``) but shards
only ``tf.data`` input itself: ``get_data_adapter`` hands a ``DataAdapter`` (a ``to_loader``) to
``fit`` before its auto-shard check. So a loader reads this process's shard by itself, or the
global batch holds each item once per process. This module decides the shard (TF-free; JAX and
Keras are looked up only when the program imported them) and checks that the processes agree
before the first step.

NOTE [ processes under keras.distribution ]
The shards are the distinct sets of batch-axis slices the processes' devices hold (read from the
device mesh): processes holding the same slices feed the same data, the others disjoint data. When
the mesh cannot be read, Keras' own rule for ``tf.data`` (``Distribution.distribute_tf_dataset``,
the same in the usual meshes): ``min(R, P)`` shards for ``R`` model replicas along the batch
dimension and ``P`` processes, this process reading ``distribution.data_shard_id`` (``R == 1``:
every process reads everything). Shards are cut as ``to_dataset``'s (``IndexOrder``: every
``num_shards``-th entry of the pass order, cut to ``n // num_shards``), so every process takes the
same steps. ``batch_size`` is the per-process batch (a step's global batch: ``batch_size *
num_shards``), split again among this process's devices, so it must divide among them
(docs/multiworker.md, *Who reads what* and *Batch sizes*).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from kerasfeed.loading.agreement import check_agreement
from kerasfeed.loading.arguments import Passes
from kerasfeed.loading.shards import ShardPlan, current_worker, joined_shards, order_shards
from kerasfeed.sampling.fingerprints import process_shards_fingerprint
from kerasfeed.sampling.protocol import order_fingerprint, order_shard, pass_fingerprint

T = TypeVar("T")

# What the processes must agree on when a loader is created, in this order.
FACTS = (
    "len(source)", "shuffle", "seed", "order fingerprint", "num_shards", "batch_size", "drop_remainder",
    "batches per pass", "batches in the first pass", "initial_state epoch", "initial_state batches", "item batch size",
    "data shard", "order shard_index",
)
SHARDS = ("data shard", "order shard_index")  # paired one to one, not equal (agreement.check_agreement)


@dataclasses.dataclass(frozen=True)
class ProcessShards:
    """This process in a multi-process Keras distribution, and the shard it reads.

    Attributes:
        num_processes, process_index: the cluster's processes and this one
            (``jax.process_count()``, ``jax.process_index()``).
        num_shards, shard_index: the data shards (the distinct sets of
            batch-axis slices the processes hold; ``min(R, P)`` in the usual
            meshes) and the one this process reads.
        local_batch_shards: the slices of the batch dimension on this
            process's devices: the per-process batch must divide by it.
        source: what decided it, for messages
            (``"keras.distribution.DataParallel"``, ...).
        batch_axis: the mesh axis of the batch dimension, for messages.
    """

    num_processes: int
    process_index: int
    num_shards: int
    shard_index: int
    local_batch_shards: int = 1
    source: str = "jax.distributed"
    batch_axis: Optional[str] = None

    def global_batch(self, batch_size: int) -> int:
        """Samples in one step's global batch when every process reads ``batch_size``."""
        return batch_size * self.num_shards


def _mesh_shards(dist: Any, jax: Any) -> Optional[tuple[int, int, int]]:
    """``(num_shards, shard_index, local_batch_shards)`` from the device mesh:
    processes whose devices cover the same slices of the batch axis read the
    same shard. None when the mesh cannot be read or its cover is irregular."""
    try:
        mesh = dist.device_mesh.backend_mesh
        axis = list(mesh.axis_names).index(dist.batch_dim_name)
        cover: dict = {}
        for idx, device in np.ndenumerate(mesh.devices):
            cover.setdefault(device.process_index, set()).add(idx[axis])
        mine = frozenset(cover[jax.process_index()])
    except Exception:  # noqa: BLE001 - a mesh this cannot read: Keras' own rule
        return None
    parts = sorted({frozenset(c) for c in cover.values()}, key=min)
    size = mesh.devices.shape[axis]
    if sum(len(c) for c in parts) != size or len(frozenset().union(*parts)) != size:
        return None  # the processes' slices overlap without being equal
    return len(parts), parts.index(mine), len(mine)


def _active_distribution() -> Any:
    """The active ``keras.distribution`` (per thread), or None; Keras is not imported."""
    keras = sys.modules.get("keras")
    if keras is None:
        return None
    try:
        return keras.distribution.distribution()
    except Exception:  # noqa: BLE001 - a backend without the distribution API
        return None


def local_distribution() -> Optional[ProcessShards]:
    """The active Keras distribution as a ``ProcessShards`` when it splits this
    process's batch among several of its devices, else None: in one process
    (``DataParallel`` over the local GPUs) that of one process; under several,
    ``current_processes()``, whatever shards the loader was given.

    Its batches must divide among those devices
    (``host_batches.check_local_batches``). Read in the thread that will
    train (the distribution is per thread).
    """
    jax = sys.modules.get("jax")
    dist = _active_distribution()
    if jax is None or dist is None:
        return None
    if int(getattr(dist, "num_processes", 1)) != 1:
        processes = current_processes()
        return processes if processes is not None and processes.local_batch_shards > 1 else None
    shards = _mesh_shards(dist, jax)
    if shards is None or shards[2] <= 1:
        return None
    return ProcessShards(1, 0, 1, 0, shards[2], f"keras.distribution.{type(dist).__name__}", dist.batch_dim_name)


def current_processes() -> Optional[ProcessShards]:
    """This process under a multi-process Keras distribution, or None.

    The active ``keras.distribution`` decides (its device mesh, else
    ``num_model_replicas`` and ``data_shard_id``); without one, a
    ``jax.distributed`` cluster of several processes (``keras.distribution.
    initialize`` ran, ``set_distribution`` not yet) reads one shard per
    process. Nothing is imported: a program that never imported JAX has no
    such cluster.
    """
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    dist = _active_distribution()
    if dist is not None and int(getattr(dist, "num_processes", 1)) > 1:
        processes, replicas = int(dist.num_processes), int(dist.num_model_replicas)
        shards = _mesh_shards(dist, jax) or (
            min(replicas, processes), int(dist.data_shard_id), max(1, replicas // processes)
        )
        source = f"keras.distribution.{type(dist).__name__}"
        return ProcessShards(processes, int(jax.process_index()), *shards, source, dist.batch_dim_name)
    if _jax_cluster(jax) and jax.process_count() > 1:
        index = int(jax.process_index())
        return ProcessShards(int(jax.process_count()), index, int(jax.process_count()), index)
    return None


def job_member() -> Optional[tuple[int, int]]:
    """``(index, count)`` of this process among its job's: JAX processes under a multi-process Keras
    distribution (``current_processes``), else the workers of a ``tf.distribute`` multi-worker strategy
    (``shards.current_worker``); None when it is alone."""
    processes = current_processes()
    if processes is not None:
        return processes.process_index, processes.num_processes
    worker = current_worker()
    return None if worker is None else (worker.worker_id, worker.num_workers)


def _jax_cluster(jax: Any) -> bool:
    """Whether ``jax.distributed.initialize`` ran in this process (no backend is started to tell)."""
    is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    if callable(is_initialized):
        return bool(is_initialized())
    # JAX before is_initialized (0.4.38, which Keras 3.7-3.9 need): its distributed module's state.
    state = getattr(sys.modules.get("jax._src.distributed"), "global_state", None)
    return getattr(state, "client", None) is not None


class _ProcessShardOrder:
    """An unsharded ``order=`` object cut into this process's shard by the same
    rule as ``IndexOrder``'s shards (every ``num_shards``-th entry, cut to
    ``shard_length // num_shards``)."""

    def __init__(self, order: Any, num_shards: int, shard_index: int):
        self.order, self.num_shards, self.shard_index = order, num_shards, shard_index
        self.shard_length = int(order.shard_length) // num_shards
        self._pass: Optional[tuple] = None  # (epoch, the order's whole pass) when it has no ``at``
        length = getattr(order, "length", None)
        if length is not None:
            self.length = length

    @property
    def fingerprint(self) -> str:
        # Without the shard index: every process resumes from one saved state.
        return process_shards_fingerprint(order_fingerprint(self.order), self.num_shards)

    @property
    def pass_fingerprint(self) -> str:
        return pass_fingerprint(self.order)  # the whole passes, whatever the number of processes

    @property
    def process_shards(self) -> tuple:
        """``(the order cut, into how many shards)``: a resume refusal names another count (``protocol``)."""
        return self.order, self.num_shards

    def indices(self, epoch: int) -> np.ndarray:
        idx = np.asarray(self.order.indices(epoch))
        return idx[self.shard_index :: self.num_shards][: self.shard_length]

    def at(self, epoch: int, positions: Any) -> np.ndarray:
        """This process's positions of pass ``epoch`` (a window at a time when the
        order has ``at`` itself; else from its whole pass, kept for the last two)."""
        g = np.asarray(positions, dtype=np.int64) * self.num_shards + self.shard_index
        if callable(getattr(self.order, "at", None)):
            return np.asarray(self.order.at(epoch, g))
        epoch = int(epoch)
        if self._pass is None or self._pass[0] != epoch:
            self._pass = (epoch, np.asarray(self.order.indices(epoch)))  # one tuple: safe to swap under threads
        return self._pass[1][g]

    def __repr__(self) -> str:
        return f"{self.order!r} (shard {self.shard_index} of {self.num_shards}: this process's)"


def process_shard_plan(processes: ProcessShards) -> Callable[[Any, int], ShardPlan]:
    """The shard resolver of a loader of this process (see ``feed.ShardResolver``): this process's
    shard; an unsharded ``order=`` object is cut into it, one built with ``num_shards > 1`` is taken
    as it is (its shards are yours).

    The resolver raises ValueError: shuffling across processes without a ``seed``, or fewer entries
    in a pass (the order's, else the source's) than shards.
    """
    n, k = processes.num_shards, processes.shard_index

    def too_short(owner: str, what: str, count: str, received: str) -> ValueError:
        return ValueError(
            f"{owner}: {what} has {count} per pass, fewer "
            f"than the {n} data shards of the {processes.num_processes}-process {processes.source} "
            f"(process {processes.process_index}): every shard needs one. Received: {received}"
        )

    def resolve(options: Any, length: int) -> ShardPlan:
        order, owner = options.order, options.owner
        together = joined_shards(processes, max(n, order_shards(order)))
        if order is not None:
            if n > 1 and int(getattr(order, "num_shards", 1) or 1) <= 1:
                if int(order.shard_length) < n:
                    raise too_short(owner, "the `order`", f"{int(order.shard_length)} entries", f"order={order!r}")
                order = _ProcessShardOrder(order, n, k)
            return ShardPlan(1, 0, 1, order, together)
        if options.shuffle and options.seed is None:
            raise ValueError(
                f"{owner}: `shuffle=True` under a {processes.num_processes}-process {processes.source} needs an "
                f"explicit `seed`: every process must draw the same permutation of every pass, so that their shards "
                "stay disjoint (or, with one shard, their batches equal). Pass the same seed on every process. "
                "Received: seed=None"
            )
        if length < n:
            raise too_short(owner, "the source", f"{length} items", f"len(source)={length}")
        return ShardPlan(n, k, n, None, together)

    return resolve


def pass_facts(total: int, passes: Passes, *, shuffle: bool, seed: Optional[int], num_shards: int,
               batch_size: Optional[int], drop_remainder: bool, item_batch_size: Any = None) -> dict:
    """``{fact: value}`` for ``FACTS``, from a pipeline's resolved passes (``item_batch_size``: with
    ``batch_size=None``, ``Feed.item_batch_size``; the front end may set it after)."""
    return {
        "len(source)": total,
        "shuffle": bool(shuffle),
        "seed": getattr(passes.order, "seed", seed) if shuffle else None,  # drawn when None: unused
        "order fingerprint": order_fingerprint(passes.order),
        "num_shards": num_shards,
        "batch_size": batch_size,
        "drop_remainder": bool(drop_remainder),
        "batches per pass": passes.per_pass,
        "batches in the first pass": passes.first_pass,
        "initial_state epoch": passes.resume.epoch,
        "initial_state batches": passes.resume.batches,
        "item batch size": item_batch_size,
        # The order's own shard where one was given sharded (an unsharded one is cut per process: its own)
        "order shard_index": order_shard(passes.order),
    }


def exchange(processes: ProcessShards, row: np.ndarray) -> np.ndarray:
    """All-gathers one int64 row per process through JAX: a ``(P, len(row))`` table
    (sent as int32 pairs: JAX has no int64 without ``jax_enable_x64``)."""
    from jax.experimental import multihost_utils

    local = np.ascontiguousarray(row, dtype=np.int64).view(np.int32)
    table = np.ascontiguousarray(np.asarray(multihost_utils.process_allgather(local)), dtype=np.int32)
    return table.reshape(processes.num_processes, -1).view(np.int64)


def agreed(processes: Optional[ProcessShards], make: Callable[[], tuple[T, dict]], *, owner: str) -> T:
    """``make()``'s object, once every process made its own and they agree.

    ``make`` returns ``(obj, facts)``; with ``processes`` None it is just called.
    Otherwise a failure in ``make`` is exchanged too (the others then raise
    instead of waiting), and ``obj`` is closed when the processes disagree.
    """
    if processes is None:
        return make()[0]

    def check(facts: Optional[dict]) -> None:
        check_agreement(
            FACTS, None if facts is None else {**facts, "data shard": processes.shard_index},
            lambda row: exchange(processes, row), owner=owner, me=processes.process_index,
            count=processes.num_processes, group=f"of the {processes.source}", shards=SHARDS,
        )

    try:
        made, facts = make()
    except Exception:
        try:
            check(None)
        except Exception:  # noqa: BLE001 - the exchange failed too: this process's own error matters
            pass
        raise
    try:
        check(facts)
    except BaseException:
        close = getattr(made, "close", None)
        if callable(close):
            close()
        raise
    return made


__all__ = [
    "FACTS", "ProcessShards", "agreed", "current_processes", "exchange", "job_member", "pass_facts",
    "process_shard_plan",
]
