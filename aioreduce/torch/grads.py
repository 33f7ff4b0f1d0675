"""Gradients as one flat tensor and back: what a single allreduce or aggregate carries."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch


def flatten_grads(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients, concatenated (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])


def write_grads(params: Iterable[torch.Tensor], flat: torch.Tensor | np.ndarray) -> None:
    """Write ``flat`` (laid out as :func:`flatten_grads` lays it) into the ``.grad`` of
    ``params``; a numpy result is read, not kept (it may be read-only: in flight elsewhere)."""
    if isinstance(flat, np.ndarray):
        with warnings.catch_warnings():  # read-only is fine: it is only read, then copied
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(np.ascontiguousarray(flat))
    offset = 0
    for p in params:
        n = p.numel()
        value = flat[offset:offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += n
