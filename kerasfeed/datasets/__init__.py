"""Synthetic data used by the demo, the tests, the notebooks and the benchmarks."""

from kerasfeed.datasets.synthetic import make_synthetic_scenes

__all__ = ["make_synthetic_scenes"]
