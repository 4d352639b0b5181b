"""``to_loader``: numpy batches from the pass pipeline, for every Keras 3 backend (TF-free)."""
