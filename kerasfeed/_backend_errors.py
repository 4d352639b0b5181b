"""Errors about Keras' backend that name the remedy (light: the standard library only)."""

from __future__ import annotations

import os
import sys
from typing import Optional


def keras_backend_error(error: BaseException, what: str) -> Optional[ModuleNotFoundError]:
    """The error to raise instead of ``error`` when it is ``import keras`` failing because Keras' backend
    is TensorFlow and TensorFlow is not installed (None otherwise). "Install TensorFlow" is then the
    wrong advice for someone who meant JAX or PyTorch: the backend is what to change."""
    if not isinstance(error, ModuleNotFoundError) or error.name is None:
        return None
    if error.name != "tensorflow" and not error.name.startswith("tensorflow."):
        return None
    # Raised inside Keras' own modules: a kerasfeed module that needs TensorFlow itself (to_dataset's)
    # fails in its own frames, and keeps its "needs TensorFlow" message.
    tb, in_keras = error.__traceback__, False
    while tb is not None and not in_keras:
        module = tb.tb_frame.f_globals.get("__name__") or ""
        in_keras, tb = module == "keras" or module.startswith("keras."), tb.tb_next
    if not in_keras:
        return None
    # The backend Keras resolved (its config module ran before the failing import); a Keras on another
    # backend that imports TensorFlow for one feature needs TensorFlow indeed.
    config = sys.modules.get("keras.src.backend.config")
    backend = getattr(config, "backend", lambda: os.environ.get("KERAS_BACKEND", "tensorflow"))()
    if backend != "tensorflow":
        return None
    if "KERAS_BACKEND" in os.environ:
        why = f"KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}"
    else:
        why = "KERAS_BACKEND is unset, so it is Keras' default or the one keras.json names ($KERAS_HOME or ~/.keras)"
    return ModuleNotFoundError(
        f"{what}: Keras' backend is 'tensorflow' ({why}), but TensorFlow is not installed. Set "
        "KERAS_BACKEND=jax or KERAS_BACKEND=torch before keras is imported (kerasfeed.to_loader feeds "
        "model.fit on those backends), or install TensorFlow: pip install 'kerasfeed[tensorflow]' (or "
        f"'kerasfeed[cpu]' for tensorflow-cpu). Received: {error}",
        name="tensorflow",
    )


__all__ = ["keras_backend_error"]
