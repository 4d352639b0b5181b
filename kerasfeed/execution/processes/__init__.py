"""Worker processes with a shared-memory transport (``executor="processes"``).

Parent side (``executor.py`` is the handle; each unit names its worker-side counterpart):

- ``executor.py``         ``ProcessExecutor``: the handle (loads, plans, streams,
                          ``stats()``), restarts after parking, the weakref finalizer
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

- ``worker.py``        ``WorkerLoop``, the loop in the child process
- ``shm.py``           nested numpy structures through shared memory
- ``channel.py``       framed messages and fd passing over a Unix socket
- ``light_modules.py`` light Keras/TensorFlow stand-ins while a worker unpickles its source
- ``frameworks.py``    the warning when a worker loads a framework anyway

The source travels by value through ``execution/pickling.py`` (h5py handles as
references each worker reopens: ``execution/h5_handles.py``). This package
imports nothing itself: a worker imports only the worker side.
"""
