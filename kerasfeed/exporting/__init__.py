"""Exports: any source written once to sharded native files, read back at tf.data speed.

- ``spec``       the element spec of an export, TF-free (inferred, checked, JSON)
- ``encoding``   lossless item <-> ``tf.train.Example`` bytes and TFRecord framing, TF-free
- ``writer``     the shard task: makes one shard's items and writes them (one writer per shard)
- ``manifest``   ``manifest.json``, shard names, checksums, verification
- ``exporter``   ``kerasfeed.export``: runs the shard tasks on an executor
- ``reader``     ``kerasfeed.load_export`` (pure TensorFlow ops) and ``verify_export``
- ``arrayrecord`` the random-access format and ``kerasfeed.ExportSource``

The package is not called ``export`` because importing a submodule binds it
as an attribute of its parent package, which would hide the public function
``kerasfeed.export``.
"""
