"""PyTorch integration (needs the ``torch`` extra): tensors in and out of the node."""

from __future__ import annotations

from .tensors import TensorResult, to_numpy

__all__ = ["TensorResult", "to_numpy"]
