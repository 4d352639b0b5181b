"""Imports TensorFlow without its start-up log lines (for the CLI and the demo).

TensorFlow writes a few lines to file descriptor 2 while it is imported, before
its logging is configured, so ``TF_CPP_MIN_LOG_LEVEL`` does not hide them: the
oneDNN notice, "All log messages before absl::InitializeLog() ...", and the
CPU-feature notice. Only those known lines are dropped; anything else written
during the import (a real error) is passed on. Numerics are untouched: oneDNN
stays on, only its notice is hidden. The library itself never does this; only
``python -m kerasfeed`` calls it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile

_NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\)|oneDNN custom operations are on"
    r"|cpu_feature_guard|This TensorFlow binary is optimized|To enable the following instructions"
    r"|Unable to register cu(DNN|FFT|BLAS) factory|computation placer already registered"
)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow (and Keras) with their start-up noise filtered out.

    Sets ``TF_CPP_MIN_LOG_LEVEL=2`` unless already set (warnings and errors of
    TensorFlow's C++ side stay visible) and absl's Python logging to errors.
    With ``TF_CPP_MIN_LOG_LEVEL=0`` set by the user it filters nothing.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules or os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0":
        return  # already imported, or the user asked to see everything
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
        except ImportError:  # not installed: kerasfeed's own message comes when it is needed
            return
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if line.strip() and not _NOISE.search(line)]
            if kept:  # anything else (a real error) is shown
                sys.stderr.write("".join(kept))
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # absl comes with TensorFlow; be safe anyway
        pass
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


__all__ = ["import_tensorflow_quietly"]
