"""Assembling sources and executors into ``tf.data.Dataset`` pipelines (needs TensorFlow)."""

import importlib.util as _util

if _util.find_spec("tensorflow") is None:
    # Checked without importing TensorFlow; every module here imports it.
    raise ModuleNotFoundError(
        "kerasfeed's tf.data front ends (to_dataset, from_generators, from_files, from_queue) need "
        "TensorFlow, which is not installed: pip install 'kerasfeed[tensorflow]' (or 'kerasfeed[cpu]' "
        "for tensorflow-cpu). Under the JAX or PyTorch backend, kerasfeed.to_loader feeds model.fit "
        "without TensorFlow. Received: no module named 'tensorflow'",
        name="tensorflow",
    )
