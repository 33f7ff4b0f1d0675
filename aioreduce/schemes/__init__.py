"""Aggregation schemes, one small module each, over the :class:`~.base.Comm` interface."""

from .base import (
    CodedScheme,
    Comm,
    FellBehind,
    Result,
    Scheme,
    Session,
    StepOptions,
    StragglerError,
)
from .registry import by_name, names
from .ring import Ring
from .star import GradientCoding, Star
from .transpose import Transpose
from .tree import CodedTree, Tree

__all__ = ["CodedScheme", "CodedTree", "Comm", "FellBehind", "GradientCoding", "Result",
           "Ring", "Scheme", "Session", "Star", "StepOptions", "StragglerError", "Transpose",
           "Tree", "by_name", "names"]
