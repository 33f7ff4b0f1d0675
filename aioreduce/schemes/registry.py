"""Schemes by name, for the bench, the examples and the tests.

A new scheme adds its module and one line here; nothing else needs to know it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Scheme
from .ring import Ring
from .star import GradientCoding, Star
from .tree import CodedTree, Tree

_SCHEMES: dict[str, Callable[..., Scheme]] = {
    "coded-tree": CodedTree,
    "gc": GradientCoding,
    "ring": Ring,
    "tree": Tree,
    "star": Star,
}


def names() -> list[str]:
    """The registered scheme names."""
    return list(_SCHEMES)


def by_name(name: str, **options: Any) -> Scheme:
    """The scheme registered as ``name``, built with ``options`` (its dataclass fields)."""
    try:
        make = _SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(_SCHEMES)}") from None
    return make(**options)
