"""The front end to_dataset and to_loader share (TF-free): options, shards, passes, the pass pipeline."""
