"""Schemes by name, for the bench, the examples and the tests.

A new scheme adds its module and one line here; nothing else needs to know it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .base import Scheme
from .ring import Ring
from .star import GradientCoding, Star
from .transpose import Transpose
from .tree import CodedTree, Tree

_SCHEMES: dict[str, Callable[..., Scheme]] = {
    "coded-tree": CodedTree,
    "gc": GradientCoding,
    "ring": Ring,
    "tree": Tree,
    "star": Star,
    "transpose": Transpose,
}


def names() -> list[str]:
    """The registered scheme names."""
    return list(_SCHEMES)


def by_name(name: str, *, strict: bool = True, **options: Any) -> Scheme:
    """The scheme registered as ``name``, built with ``options`` (its dataclass fields).

    With ``strict=False`` options the scheme does not have are ignored, so a command line can
    pass one set of options (fanout, deadline, chunk_bytes, ...) to whichever scheme it names.
    """
    try:
        make = _SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(_SCHEMES)}") from None
    fields = {f.name for f in dataclasses.fields(make) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(options) - fields)
    if unknown and strict:
        raise TypeError(f"scheme {name!r} has no options {unknown}; it takes {sorted(fields)}")
    return make(**{k: v for k, v in options.items() if k in fields})
