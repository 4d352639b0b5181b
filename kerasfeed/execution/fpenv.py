"""The floating-point environment of the threads kerasfeed starts.

NOTE [ Threads that run the source start with the default floating-point environment ]
TensorFlow's threads set flush-to-zero and denormals-are-zero (MXCSR FTZ/DAZ
on x86; FPCR.FZ on ARM): a ``tf.numpy_function`` body makes
``np.float32(1e-38) / np.float32(1e4)`` and even ``np.array([1e-45],
np.float32)`` zero, and a thread inherits its creator's environment
(measured: a Python thread started from a ``numpy_function`` body flushes
too). ``to_dataset``'s first call of a pass runs on such a thread and starts
the threads executor's pool (``ThreadExecutor.plan``) and aside threads, so
items lost their subnormal values on that path only, while worker
processes, ``to_loader`` and ``export`` kept them. So every thread kerasfeed
starts to run the source first sets the default environment
(``fesetenv(FE_DFL_ENV)``: ~0.4 us, once per thread): the same bits on every
path. A load in the caller's thread (the main thread, outside a plan) keeps
that thread's environment: it is the user's own.

The source's epoch hooks (``set_epoch``, ``on_epoch_begin``, ``on_epoch_end``)
run in the consumer's thread, under ``to_dataset`` one of TensorFlow's: a
hook computing what later items use (a scale, a normalisation) got flushed
values there, and so did those items. ``default_fp_env()`` runs them with the
default environment, then gives the thread its own back (TensorFlow's ops).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator


@functools.lru_cache(maxsize=None)
def _found() -> Any:
    """``(fesetenv, FE_DFL_ENV, fegetenv or None)``, looked up once; False where unavailable."""
    import ctypes

    try:
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL("libm.so.6")
            except OSError:
                lib = ctypes.CDLL(None)  # musl: in libc
            default_env = ctypes.c_void_p(-1).value  # glibc and musl: FE_DFL_ENV is ((const fenv_t *) -1)
        elif sys.platform == "darwin":
            lib = ctypes.CDLL("libSystem.B.dylib")
            default_env = ctypes.addressof(ctypes.c_char.in_dll(lib, "_FE_DFL_ENV"))
        else:
            return False
        fesetenv = lib.fesetenv
    except (OSError, AttributeError, ValueError):
        return False
    fesetenv.argtypes = [ctypes.c_void_p]
    fesetenv.restype = ctypes.c_int
    fegetenv = getattr(lib, "fegetenv", None)
    if fegetenv is not None:
        fegetenv.argtypes = [ctypes.c_void_p]
        fegetenv.restype = ctypes.c_int
    return fesetenv, default_env, fegetenv


# Bytes kept for a saved fenv_t (32 on x86-64 glibc, 8 on AArch64): room to spare.
_FENV_BYTES = 256


def set_default_fp_env() -> None:
    """Gives the calling thread the default floating-point environment (no
    flush-to-zero, round to nearest, exceptions masked); a no-op on platforms
    without ``fesetenv``."""
    found = _found()
    if found:
        fesetenv, default_env, _ = found
        fesetenv(default_env)


@contextlib.contextmanager
def default_fp_env() -> Iterator[None]:
    """Runs the block with the default floating-point environment, then gives
    the thread back the one it had (a no-op where it cannot be saved)."""
    found = _found()
    if not found or found[2] is None:
        yield
        return
    import ctypes

    fesetenv, default_env, fegetenv = found
    saved = ctypes.create_string_buffer(_FENV_BYTES)
    if fegetenv(saved) != 0:
        yield
        return
    fesetenv(default_env)
    try:
        yield
    finally:
        fesetenv(saved)


__all__ = ["default_fp_env", "set_default_fp_env"]
