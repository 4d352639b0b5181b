"""kerasfeed: fast custom Python data loading for Keras and tf.data.

The public API lives here. Heavy modules (TensorFlow, Keras, h5py) are
imported lazily on first attribute access so that ``import kerasfeed`` stays
cheap, which matters most inside worker processes. The package is a stack of
layers, each importing only those under it: ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from kerasfeed._version import __version__

# public name -> "module:attribute"
_LAZY = {
    "SceneSequence": "kerasfeed.sources.sequence:SceneSequence",
    "to_dataset": "kerasfeed.tfdata.adapter:to_dataset",
    "executor_of": "kerasfeed.observe.lookup:executor_of",
    "IndexOrder": "kerasfeed.sampling.order:IndexOrder",
    "ResumeState": "kerasfeed.sampling.state:ResumeState",
    "TrainingProgress": "kerasfeed.integrations.keras:TrainingProgress",
    "BackupAndRestore": "kerasfeed.integrations.backup:BackupAndRestore",
    "item_rng": "kerasfeed.sources.item_random:item_rng",
    "Cache": "kerasfeed.cache.options:Cache",
    # Orbax: the data position in the same checkpoint as the model (kerasfeed.orbax: custom loops).
    "OrbaxCheckpoint": "kerasfeed.integrations.orbax_callback:OrbaxCheckpoint",
    "orbax": "kerasfeed.integrations.orbax:",
    "ItemError": "kerasfeed.errors:ItemError",
    "SignatureError": "kerasfeed.errors:SignatureError",
    "WorkerError": "kerasfeed.errors:WorkerError",
    "StreamError": "kerasfeed.errors:StreamError",
    "KerasStructureError": "kerasfeed.errors:KerasStructureError",
    "KerasStructureWarning": "kerasfeed.errors:KerasStructureWarning",
    "from_generators": "kerasfeed.tfdata.sharded_datasets:from_generators",
    "from_files": "kerasfeed.tfdata.sharded_datasets:from_files",
    "from_queue": "kerasfeed.tfdata.queue_dataset:from_queue",
    "END_OF_EPOCH": "kerasfeed.streams.queue:END_OF_EPOCH",
    "get_worker_info": "kerasfeed.execution.worker_info:get_worker_info",
    "WorkerInfo": "kerasfeed.execution.worker_info:WorkerInfo",
    "ProcessExecutor": "kerasfeed.execution.processes.executor:ProcessExecutor",
    "RayExecutor": "kerasfeed.execution.ray.executor:RayExecutor",  # needs the `ray` extra when used
    "datasets": "kerasfeed.datasets:",
    "H5SliceSequence": "kerasfeed.hdf5:H5SliceSequence",
    "H5WindowSequence": "kerasfeed.hdf5:H5WindowSequence",
    "ScenePointSampler": "kerasfeed.transforms:ScenePointSampler",
    # Observability: live input stats, the Keras/TensorBoard callback, the profiler
    "stats": "kerasfeed.observe.api:stats",
    "InputStats": "kerasfeed.integrations.input_stats:InputStats",
    "profile": "kerasfeed.observe.profile:profile",
    # Sampling at the index level: balanced and weighted orders, mixing sources.
    "BalancedOrder": "kerasfeed.sampling.balanced:BalancedOrder",
    "WeightedOrder": "kerasfeed.sampling.weighted:WeightedOrder",
    "mix": "kerasfeed.sampling.mix:mix",
    "H5RowSequence": "kerasfeed.hdf5:H5RowSequence",
    "FileChangedError": "kerasfeed.hdf5:FileChangedError",
    # Exports: sharded TFRecord/ArrayRecord files written in parallel (kerasfeed/exporting)
    "export": "kerasfeed.exporting.exporter:export",
    "load_export": "kerasfeed.exporting.reader:load_export",
    "verify_export": "kerasfeed.exporting.reader:verify_export",
    "ExportSource": "kerasfeed.exporting.arrayrecord:ExportSource",
    "ExportError": "kerasfeed.exporting.manifest:ExportError",
    # multi-worker training (tf.distribute): one shard per worker, per-worker summaries
    "distribute": "kerasfeed.integrations.distribute:distribute",
    "worker_run_dir": "kerasfeed.integrations.summaries:worker_run_dir",
    "WorkerSummaries": "kerasfeed.integrations.summaries:WorkerSummaries",
    # Keras 3 backends without TensorFlow: numpy batches and a Keras data adapter.
    "to_loader": "kerasfeed.loader.api:to_loader",
    "Loader": "kerasfeed.loader.loader:Loader",
}

__all__ = ["__version__", *_LAZY]
_STREAMS = ("from_generators", "from_files", "from_queue")  # tf.data only: to_loader takes no stream


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kerasfeed' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    # Before TensorFlow is imported (and JAX with it, and JAX's gc callback): a
    # Ctrl-C handled there would be dropped (NOTE [ A Ctrl-C that Python swallows ]).
    from kerasfeed.execution.interrupts import interrupts_held, keep_interrupts

    keep_interrupts()
    try:
        with interrupts_held():  # NOTE [ Ctrl-C while TensorFlow is imported ]
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != "tensorflow" and not (e.name or "").startswith("tensorflow."):
            raise
        from kerasfeed._backend_errors import keras_backend_error

        backend_error = keras_backend_error(e, f"kerasfeed.{name}")
        if backend_error is not None:
            raise backend_error from e
        # TensorFlow is optional (to_dataset and the stream functions need it).
        instead = (" Streams are tf.data datasets: without TensorFlow, make the data indexable (a class with "
                   "__len__ and __getitem__) for kerasfeed.to_loader." if name in _STREAMS else
                   " Under the JAX or PyTorch backend, kerasfeed.to_loader feeds model.fit without TensorFlow.")
        raise ModuleNotFoundError(
            f"kerasfeed.{name} needs TensorFlow, which is not installed: pip install 'kerasfeed[tensorflow]' "
            f"(or 'kerasfeed[cpu]' for tensorflow-cpu).{instead} Received: {e}",
            name="tensorflow",
        ) from e
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public API and the module's dunders: not the helpers this file imports (importlib, Any).
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
