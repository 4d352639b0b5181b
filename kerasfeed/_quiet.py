"""Imports TensorFlow without its start-up log lines (only ``python -m kerasfeed`` does; never the library).

TensorFlow writes a few lines to file descriptor 2 while it is imported, before its logging is
configured, so ``TF_CPP_MIN_LOG_LEVEL`` does not hide them: the oneDNN notice (oneDNN stays on),
"All log messages before absl::InitializeLog() ...", the CPU-feature notice. Only those known lines
are dropped; anything else written during the import (a real error) is passed on.
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
    """Imports TensorFlow (and Keras) quietly: ``TF_CPP_MIN_LOG_LEVEL=2`` unless set (C++ warnings and
    errors stay visible; with 0 nothing is filtered) and absl's Python logging at errors."""
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
