"""Aggregation schemes, one small module each, over the :class:`~.base.Comm` interface."""

from .base import Comm, Result, StepOptions, StragglerError
from .ring import Ring
from .star import GradientCoding, Star
from .tree import CodedTree, Tree

Scheme = CodedTree | GradientCoding | Ring | Tree | Star

__all__ = ["CodedTree", "Comm", "GradientCoding", "Result", "Ring", "Scheme", "Star",
           "StepOptions", "StragglerError", "Tree"]
