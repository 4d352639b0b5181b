"""Observability: live input stats, the Keras/TensorBoard callback and the profiler."""
