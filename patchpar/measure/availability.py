"""A metric that cannot run here says why instead of crashing or inventing a number. Shared by
the metric maths (`quality.py`) and the feature extractors (`features.py`), which import it and
not each other."""

from __future__ import annotations


class Unavailable(RuntimeError):
    """A metric cannot run here (a weights file is absent); the message says what is missing."""


def guarded(name: str, fn) -> dict:
    """{name: fn()} or, when a weights file or a package is missing, {name: None,
    name_unavailable: reason}: no crash, no made-up number."""
    try:
        return {name: fn()}
    except ImportError as e:
        return {name: None, f"{name}_unavailable": f"missing package: {e}"}
    except Unavailable as e:
        return {name: None, f"{name}_unavailable": str(e)}
