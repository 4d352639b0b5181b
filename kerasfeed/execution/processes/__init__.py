"""Worker processes with a shared-memory transport (``executor="processes"``).

- ``pool.py``      persistent pool: start-up, dispatch, death detection, shutdown
- ``worker.py``    the worker loop (runs in the child process)
- ``shm.py``       nested numpy structures through shared memory
- ``channel.py``   framed messages and fd passing over a Unix socket
- ``pickling.py``  sending the source by value, with errors that name the culprit
- ``executor.py``  ``ProcessExecutor``, the ``Executor`` the tf.data adapter uses
"""

from kerasfeed.execution.processes.executor import ProcessExecutor
from kerasfeed.execution.processes.pool import PoolOptions, StreamIterator, WorkerPool

__all__ = ["ProcessExecutor", "WorkerPool", "PoolOptions", "StreamIterator"]
