"""Assembling sources and executors into ``tf.data.Dataset`` pipelines."""
