"""``python -m kerasfeed profile MODULE:FACTORY``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Optional


def load_target(target: str) -> Any:
    """The source named by ``MODULE:FACTORY`` (``MODULE``: an importable module name or a path to a
    ``.py`` file): ``FACTORY()`` when it is a callable that is not itself indexable, else the object.

    Raises:
        ValueError: not ``MODULE:NAME``, or the module has no such name.
        ImportError: the module cannot be imported.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Expected MODULE:FACTORY, e.g. mypackage.data:make_source. Received: {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        spec = importlib.util.spec_from_file_location("_kerasfeed_profile_target", module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"Cannot import {module_name!r} as a Python file. Received: {target!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        # Workers cannot import this module by its made-up name: its classes and functions go by value.
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # `python -m` puts the cwd first; keep that for modules next to the user
        module = importlib.import_module(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"Module {module_name!r} has no attribute {attr!r}. Received: {target!r}") from None
    if callable(obj) and not hasattr(obj, "__getitem__"):
        obj = obj()
    elif isinstance(obj, type):
        obj = obj()
    return obj


def _counts(name: str, text: Optional[str]) -> Optional[list]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"`--{name}` must be comma-separated ints, e.g. 1,2,4. Received: {text!r}") from None


def run_profile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from kerasfeed.observe.profile import profile

    if args.chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kerasfeed profile: matplotlib is not installed; no chart (pip install matplotlib).", file=sys.stderr)
            args.chart = ""
    try:
        source = load_target(args.target)
        report = profile(
            source, items=args.items, batch_size=args.batch_size, workers=_counts("workers", args.workers),
            threads=_counts("threads", args.threads), chart=args.chart or None,
        )
    except (ValueError, TypeError, ImportError) as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=str))
    else:
        print(report.table())
        if args.chart:
            print(f"\n  chart: {os.path.abspath(args.chart)}")
    return 0


__all__ = ["run_profile", "load_target"]
