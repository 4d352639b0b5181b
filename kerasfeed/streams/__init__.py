"""Streams: sources that are iterated, not indexed.

- ``interleave.py``  one pass over many shards (generators, files): producers run ahead with
                     bounded buffers, the consumer takes items in tf.data ``interleave`` order
                     or as they arrive
- ``shards.py``      ``ShardedStream``: where shards run (threads or worker processes) and what
                     each pass reads
- ``queue.py``       ``QueueFeed`` and ``END_OF_EPOCH``: a producer that does not know the epoch
                     length feeding a bounded queue

This package is TensorFlow-free; ``kerasfeed.tfdata.stream_assembly`` turns a stream into a
``tf.data.Dataset`` (``from_generators``, ``from_files``, ``from_queue``).
"""

from kerasfeed.streams.queue import END_OF_EPOCH

__all__ = ["END_OF_EPOCH"]
