"""The data and model the torch examples share: scikit-learn's handwritten digits (1797
8x8 images, shipped with the package: nothing to download) and a small MLP."""

from __future__ import annotations

import numpy as np
import torch


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y): 80/20, split the same way on every rank."""
    from sklearn.datasets import load_digits  # the ``examples`` extra
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def mlp(hidden: int = 128) -> torch.nn.Module:
    """The same initial weights on every rank (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
