"""Turns the ``executor=`` argument of the public API into an Executor."""

from __future__ import annotations

import warnings
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed.execution.base import Executor
from kerasfeed.execution.processes.options import PoolOptions
from kerasfeed.execution.threads import ThreadExecutor

EXECUTOR_NAMES = ("threads", "processes", "auto")  # and "ray", which needs an extra (`kerasfeed[ray]`)


def make_executor(
    executor: Any, source: Any, options: Optional[PoolOptions] = None, *, handover: str = "tensorflow"
) -> Executor:
    """Returns an Executor for ``source``.

    Args:
        executor: one of ``EXECUTOR_NAMES`` or an ``Executor`` instance.
        source: the indexable source.
        options: the ``PoolOptions`` built (and checked) from the public
            keywords ``workers``/``worker_init``/``seed``, used whole by the
            process executors; the threads executor takes its ``timeout``,
            ``retries`` and ``seed`` (``kerasfeed.item_rng()``) and refuses
            ``worker_max_items``/``worker_max_rss`` (``"auto"`` ignores them
            when it picks threads). None = defaults.
        handover: who takes the items, for ``"auto"``'s decision:
            ``"tensorflow"`` (``to_dataset``) or ``"numpy"`` (``to_loader``).

    Raises:
        ValueError: an unknown executor, or process-only options with
            ``executor="threads"``.
    """
    options = options or PoolOptions()
    if isinstance(executor, Executor):
        _check_instance(executor, source, options)
        return executor
    if executor == "threads":
        if options.given:
            raise ValueError(
                "`workers` and `worker_init` apply to worker processes; "
                f"executor='threads' received workers={options.workers!r}, worker_init={options.worker_init!r}"
            )
        if options.recycles:
            raise ValueError(
                "`worker_max_items` and `worker_max_rss` recycle worker processes; threads cannot be replaced "
                "that way (use executor='processes'). Received: "
                f"worker_max_items={options.worker_max_items!r}, worker_max_rss={options.worker_max_rss!r}"
            )
        return ThreadExecutor.from_options(source, options)
    if executor == "processes":
        from kerasfeed.execution.processes.executor import ProcessExecutor

        return ProcessExecutor.from_options(source, options)
    if executor == "ray":  # Ray actors (execution/ray/): optional, imported only here
        from kerasfeed.execution.ray.executor import RayExecutor

        return RayExecutor.from_options(source, options)
    if executor == "auto":
        from kerasfeed.execution.auto import make_auto_executor

        return make_auto_executor(source, options, handover=handover)
    raise ValueError(
        f"`executor` must be one of {EXECUTOR_NAMES} (or 'ray': Ray actors, with the `ray` extra) or a kerasfeed "
        f"Executor. Received: {executor!r}"
    )


def _check_instance(executor: Executor, source: Any, options: PoolOptions) -> None:
    # An executor runs the source it was made with: another source's items would come back under this
    # one's indices, and options given beside it would be ignored.
    own = getattr(executor, "source", None)
    if own is not source:
        raise ValueError(
            f"The executor given runs another source ({type(own).__name__} at {id(own):#x}) than the one to read "
            f"({type(source).__name__} at {id(source):#x}): an executor reads the source it was made with. Pass "
            f"executor='{executor.name}' (or make the executor with this source). Received: executor={executor!r}"
        )
    if options.given:
        raise ValueError(
            "`workers` and `worker_init` apply to an executor kerasfeed makes; the one given was made with its "
            f"own. Received: workers={options.workers!r}, worker_init={options.worker_init!r}, executor={executor!r}"
        )
    if options.seed is not None and executor.item_seed != options.seed and not executor.seed_warned:
        # The pipeline's seed orders the items; the items' own random numbers come from the executor (once per
        # executor: a source that draws none need not hear it for every pipeline).
        executor.seed_warned = True
        drawn = executor.item_seed is None
        warnings.warn(
            f"seed={options.seed} orders the items, but kerasfeed.item_rng() (and the reseeded random and "
            f"numpy.random of worker processes) draw from the executor's own seed, "
            f"{'drawn when it was made' if drawn else executor.item_seed}: the items' random numbers would differ "
            f"from executor='{executor.name}' with seed={options.seed}{', and from run to run' if drawn else ''}. "
            f"Make the executor with seed={options.seed} too. Received: seed={options.seed}, executor={executor!r}",
            UserWarning,
            stacklevel=_v.caller_stacklevel(),
        )
    if options.retries or options.recycles:
        raise ValueError(
            "`retries`, `worker_max_items` and `worker_max_rss` apply to an executor kerasfeed makes; the one given "
            "was made with its own (pass them to it). Received: "
            f"retries={options.retries!r}, worker_max_items={options.worker_max_items!r}, "
            f"worker_max_rss={options.worker_max_rss!r}, executor={executor!r}"
        )
