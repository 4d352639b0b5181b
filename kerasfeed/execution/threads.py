"""Run items in the consumer process, on tf.data's (private) thread pool."""

from __future__ import annotations

from typing import Any

from kerasfeed.errors import ItemError
from kerasfeed.execution.base import Executor
from kerasfeed.sources.base import source_name

# Latency-bound sources (network stores, sleeps) need many calls in flight;
# tf.data's default pool stops near the core count (FIELD_NOTES #3).
DEFAULT_THREAD_PARALLELISM = 64


class ThreadExecutor(Executor):
    """Calls ``source[index]`` directly in the calling (tf.data) thread.

    Best for sources that release the GIL: I/O waits, sleeps, large numpy
    operations. Pure-Python and h5py work does not scale with threads.

    Args:
        source: the indexable source.
        parallelism: default number of concurrent calls.
    """

    name = "threads"

    def __init__(self, source: Any, parallelism: int = DEFAULT_THREAD_PARALLELISM):
        self._source = source
        self._name = source_name(source)
        self._parallelism = parallelism

    def load(self, index: int, epoch: int) -> Any:
        del epoch  # the consumer's source already saw set_epoch for this pass
        try:
            return self._source[index]
        except Exception as e:
            raise ItemError.from_exception(index, e, source_name=self._name) from e

    def parallel_calls(self) -> int:
        return self._parallelism
