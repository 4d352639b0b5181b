"""``to_loader``: any indexable source as numpy batches, for every Keras 3 backend.

Resolves the arguments once (``LoaderOptions``), opens the front end's feed
(shards, passes, executor: ``kerasfeed/loading/feed.py``) and makes the
``Loader`` (``loader.py``) as a Keras data adapter (``keras_adapter.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Union

from kerasfeed.execution.base import Executor
from kerasfeed.loader.keras_adapter import loader_class
from kerasfeed.loader.loader import Loader
from kerasfeed.loader.options import LoaderOptions
from kerasfeed.loading import host_batches, hosts
from kerasfeed.loading.feed import open_feed
from kerasfeed.loading.shards import given_shards
from kerasfeed.sources.base import source_length


def to_loader(
    source: Any,
    *,
    batch_size: Optional[int] = None,
    shuffle: bool = False,
    seed: Optional[int] = None,
    executor: Union[str, Executor] = "threads",
    workers: Optional[int] = None,
    worker_init: Optional[Callable[[], None]] = None,
    drop_remainder: bool = False,
    padding_values: Any = None,
    ragged: bool = False,
    probe: int = 3,
    num_shards: Optional[int] = None,
    shard_index: Optional[int] = None,
    initial_state: Optional[Mapping[str, int]] = None,
    order: Any = None,
    input_context: Any = None,
    copy: bool = False,
    device_prefetch: Optional[int] = None,
    timeout: Optional[float] = None,
    retries: int = 0,
    max_skipped: Union[int, float] = 0,
    worker_max_items: Optional[int] = None,
    worker_max_rss: Optional[int] = None,
    cache: Any = None,
) -> Loader:
    """Turns an indexable source into numpy batches for any Keras 3 backend.

    The batches, their order and the pass numbering are those of
    ``to_dataset`` with the same arguments, without TensorFlow: ``source[i]``
    runs on the executor (threads or worker processes with shared memory),
    which makes each pass's items ahead; batching happens in numpy. Pass the
    result to ``model.fit``/``evaluate``/``predict`` on the JAX, PyTorch or
    TensorFlow backend (Keras >= 3.7), or iterate it in a custom loop.

    Args:
        source: an object with ``__len__`` and ``__getitem__``, such as a
            ``kerasfeed.SceneSequence`` or ``keras.utils.PyDataset``.
        batch_size: None when items are already batches (the Keras
            convention); an int to treat items as samples and stack them.
        shuffle: read items in a new seeded random order every pass.
        seed: seed of the shuffle (and base seed of worker processes).
        executor: ``"threads"``, ``"processes"``, ``"auto"`` or an
            ``Executor`` instance made with this very ``source`` (not
            closed by the loader).
        workers: number of worker processes (process executors only).
        worker_init: called once in each worker process.
        drop_remainder: with ``batch_size``, drop the last short batch.
        padding_values: with ``batch_size``, what samples whose shapes vary
            are padded with: one scalar, or a nest shaped like the items;
            default 0 (``b""`` for strings).
        ragged: not supported: numpy has no ragged arrays (pad, or return
            whole batches with ``batch_size=None``).
        probe: leading items probed (and the last) to learn the structure,
            dtypes and which dimensions may vary; a shard probes the first
            items of its own first pass instead, as ``to_dataset``'s do.
        num_shards: split every pass into this many disjoint, equal shards,
            as ``to_dataset`` splits them. None: one shard per process under
            a multi-process Keras distribution on JAX (``DataParallel``,
            ``ModelParallel`` along its batch dimension; see below), else 1.
        shard_index: the shard this loader yields. None: this process's
            under a multi-process distribution; with ``num_shards`` given in
            a JAX cluster of several processes, this process's index when
            ``num_shards`` equals their number (1: shard 0; another count
            is refused: pass ``shard_index``); else 0.
        initial_state: ``{"epoch": e, "batches": b}`` (from
            ``TrainingProgress``): the first pass is pass ``e`` and starts
            after its first ``b`` batches; use ``fit(..., initial_epoch=e)``.
            A state saved with an order fingerprint is refused with another order.
        order: the index order of every pass instead of ``shuffle``/``seed``/
            ``num_shards``/``shard_index``: any object with ``shard_length``
            and ``indices(epoch)``, such as ``kerasfeed.BalancedOrder`` or
            ``kerasfeed.WeightedOrder`` (as in ``to_dataset``; its seed seeds
            ``kerasfeed.item_rng()``).
        input_context: a ``tf.distribute.InputContext``, or any object with
            ``num_input_pipelines`` and ``input_pipeline_id`` (TensorFlow is
            not needed): sets ``num_shards``/``shard_index`` to them, as in
            ``to_dataset``.
        copy: False (the default): batches are handed over without a copy
            where that is safe: with ``batch_size=None``, the arrays
            ``source[i]`` returned (threads) or views of the worker's shared
            memory, which stays lent to the batch until the batch and every
            view of it are gone (processes). True: every batch is made of
            fresh arrays that share nothing with the source or the workers
            (one copy per batch). See docs/backends.md.
        device_prefetch: batches placed on the accelerator ahead of the step
            by a thread of the loader, where Keras' JAX trainer would put
            them (its distribution's data sharding, or the default device)
            or, for PyTorch, on the device from pinned memory with
            non-blocking copies. None (the default): 2 when batches go to an
            accelerator, 0 on a CPU; 0: off (Keras places each batch in the
            training thread). Plain ``iter(loader)`` always yields numpy.
            See ``kerasfeed/loader/device.py``.
        timeout: seconds one item may take, counted from when its thread or
            worker process is ready to run it; then the item fails
            (``TimeoutError`` from threads, ``kerasfeed.WorkerError`` from a
            worker, which is killed). None (the default) waits as long as the
            worker lives. As in ``to_dataset``.
        retries: how many more times an item is tried after an attempt that
            raised, ran past ``timeout`` or whose worker died (the worker is
            replaced); 0 (the default): the first failure fails the item.
        max_skipped: items of a pass that may still fail after their retries
            and be left out: an int count, or a float in (0, 1), a fraction
            of the pass; 0 (the default): none. With ``batch_size`` the batch
            that held one is one sample shorter (a pass keeps its number of
            batches); with ``batch_size=None`` the pass is one batch shorter.
            Logged, counted in ``kerasfeed.stats`` and kept with resume
            states, as in ``to_dataset`` (``docs/reliability.md``).
        worker_max_items, worker_max_rss: a worker process that was sent
            this many items, or whose resident memory passed this many bytes,
            finishes its items and is replaced (None: never).
        cache: keep items once made, so that later passes read them instead
            of making them again: ``"memory"`` (RAM, freed with the
            pipeline), a directory path (kept on local disk and reused by the
            next run while the source is unchanged), a ``kerasfeed.Cache``
            (its ``max_bytes`` and ``version``), or None (the default). With a
            source that defines ``load(i)`` and ``augment(item)``, only
            ``load`` is stored and ``augment`` runs every pass. Items are
            bit-identical to an uncached run's. See ``docs/cache.md``.

    Under a multi-process ``keras.distribution`` (JAX; one process per host)
    each process reads only its own shard of every pass (processes whose
    devices hold the same slices of the batch axis read the same one: Keras'
    own rule for ``tf.data`` in the usual meshes), with equal steps on every
    process; ``batch_size`` is then the *per-process* batch (the global batch
    is ``batch_size`` times the number of shards), and it must divide among
    this process's devices. Every process must create its loaders in the same
    order, with the same arguments: they check at creation that they agree on
    length, seed, order and batching (explicit ``num_shards``/``shard_index``/
    ``input_context`` skip this check). With ``batch_size=None`` every item
    must then be a batch of the same size (the probes, which include the
    source's last item, and every item as it is read). See ``docs/multiworker.md``.

    Returns:
        A ``kerasfeed.Loader``: ``iter(loader)`` reads one pass of numpy
        batches; ``loader.torch()`` / ``loader.jax()`` convert them. It is a
        ``keras`` data adapter, so ``model.fit(loader, epochs=n)`` works.

    Raises:
        TypeError, ValueError: a non-indexable, empty or infinite source
            (``num_batches`` None: ``to_dataset`` takes those), or bad
            arguments (``ragged=True`` included); under several processes,
            ones that disagree, a per-process batch that does not divide
            among the local devices, or ``shuffle`` without a ``seed``.
        RuntimeError: Keras older than 3.7 (it cannot take a data adapter);
            another process failed to create its loader.
        kerasfeed.ItemError: ``source[i]`` raised (while probing or
            iterating): index, type, message and traceback.
        kerasfeed.SignatureError: an item does not fit the probed structure.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Points(kerasfeed.SceneSequence):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full((4, 3), i, "float32"), np.int64(i % 2)

    loader = kerasfeed.to_loader(Points(), batch_size=4, shuffle=True, seed=0)
    for x, y in loader:
        print(x.shape, y.shape)  # (4, 4, 3) (4,) ... then (2, 4, 3) (2,)
    ```
    """
    arguments = dict(locals())  # every argument but `source` is a LoaderOptions field of the same name
    del arguments["source"]
    # Under a multi-process Keras distribution (JAX) the processes check that they agree
    # (kerasfeed/loading/hosts.py); explicit shards skip the check, but `num_shards` alone
    # still means this process's shard in a cluster (shards.given_shards).
    # NOTE [ The first import of Keras keeps its callers' frames ]
    # Under TensorFlow, the first `import keras` leaves a reference cycle that
    # holds the frames on the stack then (each frame holds its caller). Made
    # here, before any local holds a loader, it keeps none: made inside
    # make(), the first loader (its workers and fds) lived until the cyclic GC.
    adapter = loader_class()  # also checks the Keras version before any worker starts
    explicit = input_context is not None or num_shards is not None or shard_index is not None
    cluster = hosts.current_processes()
    processes = None if explicit else cluster

    def make() -> tuple[Loader, Optional[dict]]:
        total = source_length(
            source, owner="to_loader",
            why_finite="a loader is a sequence of passes of known length (num_batches, len(loader))",
            infinite_remedy="Give the source a length, or use kerasfeed.to_dataset (TensorFlow), which takes "
                            "infinite sources (fit with steps_per_epoch).",
        )
        options = LoaderOptions(**arguments)
        if processes is None:
            shards = functools.partial(given_shards, cluster=cluster)
        else:
            shards = hosts.process_shard_plan(processes)
        loader = adapter(open_feed(source, total, options, shards), options)
        try:
            if processes is None:
                # One process with several devices, or explicit shards under several processes.
                loader.check_batches(hosts.local_distribution())
                return loader, None
            facts = loader._join(processes)
            facts["item batch size"] = host_batches.item_batch_fact(loader._feed.item_batch_size)
            return loader, facts
        except BaseException:
            loader.close()
            raise

    return hosts.agreed(processes, make, owner="to_loader")


__all__ = ["to_loader"]
