"""Observability: live input stats, finding the pipeline behind a dataset or loader, the profiler."""
