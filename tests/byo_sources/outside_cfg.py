"""A configuration module another module's source reads (``outside_cfg.SCALE``, ``scale()``)."""

SCALE = 1


def scale():
    return SCALE
