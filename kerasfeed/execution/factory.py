"""Turns the ``executor=`` argument of the public API into an Executor."""

from __future__ import annotations

from typing import Any, Callable, Optional

from kerasfeed.execution.base import Executor
from kerasfeed.execution.threads import ThreadExecutor

EXECUTOR_NAMES = ("threads", "processes", "auto")


def make_executor(
    executor: Any,
    source: Any,
    *,
    workers: Optional[int] = None,
    worker_init: Optional[Callable[[], None]] = None,
    seed: Optional[int] = None,
    timeout: Optional[float] = None,
) -> Executor:
    """Returns an Executor for ``source``.

    Args:
        executor: one of ``EXECUTOR_NAMES`` or an ``Executor`` instance.
        source: the indexable source.
        workers: number of worker processes (process executors only).
        worker_init: called once in each worker process at start-up.
        seed: base seed of the worker processes (worker k gets seed + k).
        timeout: seconds one item may take once its thread or worker is
            ready; None = no limit. Ignored for an ``Executor`` instance.
    """
    if isinstance(executor, Executor):
        return executor
    if executor == "threads":
        if workers is not None or worker_init is not None:
            raise ValueError(
                "`workers` and `worker_init` apply to worker processes; "
                f"executor='threads' received workers={workers!r}, worker_init={worker_init!r}"
            )
        return ThreadExecutor(source, timeout=timeout)
    if executor == "processes":
        # Imported here: keeps subprocess/socket machinery out of `import kerasfeed`.
        from kerasfeed.execution.processes.executor import ProcessExecutor

        return ProcessExecutor(source, workers=workers, worker_init=worker_init, seed=seed, timeout=timeout)
    if executor == "auto":
        from kerasfeed.execution.auto import make_auto_executor

        return make_auto_executor(source, workers=workers, worker_init=worker_init, seed=seed, timeout=timeout)
    raise ValueError(
        f"`executor` must be one of {EXECUTOR_NAMES} or a kerasfeed Executor. "
        f"Received: {executor!r}"
    )
