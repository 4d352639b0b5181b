"""Random-access sources: anything with ``__len__`` and ``__getitem__``."""
