"""Worker processes with a shared-memory transport (``executor="processes"``).

Parent side (``pool.py`` is the façade; each unit names its worker-side counterpart):

- ``pool.py``             ``WorkerPool``: the public handle, ``stats()``
- ``dispatcher.py``       the one lock: loads (and their retries), plans
- ``shutdown.py``         parking and close ordering
- ``readers.py``          the reader thread of each worker; a worker's death
- ``replacement.py``      successors of dead, hung or recycled workers;
                          NOTE [ Replacing a worker ]
- ``pass_plans.py``       the pass requested ahead and the next pass
- ``lanes.py``            each worker's requests; which worker takes the next one
- ``slots.py``            shared-memory slots and the lending budget
- ``stream_sessions.py``  generator streams (``StreamIterator``)
- ``process.py``          one worker process: launch, send, explain an exit, stop;
                          NOTE [ Worker process shutdown ]
- ``protocol.py``         the messages, one type each, both directions
- ``options.py``          ``PoolOptions``

Worker side and shared:

- ``worker.py``    ``WorkerLoop``, the loop in the child process
- ``shm.py``       nested numpy structures through shared memory
- ``channel.py``   framed messages and fd passing over a Unix socket
- ``pickling.py``  sending the source by value, with errors that name the culprit
- ``executor.py``  ``ProcessExecutor``, the ``Executor`` the tf.data adapter uses
"""

from kerasfeed.execution.processes.executor import ProcessExecutor
from kerasfeed.execution.processes.pool import PoolOptions, StreamIterator, WorkerPool

__all__ = ["ProcessExecutor", "WorkerPool", "PoolOptions", "StreamIterator"]
