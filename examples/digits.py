"""The data and model the torch examples share: scikit-learn's handwritten digits (1797
8x8 images, shipped with the package: nothing to download) and a small MLP."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y): 80/20, split the same way on every rank."""
    pixels, labels = _load()
    x = torch.tensor(pixels / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def _load() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels and labels. Read from the file scikit-learn ships (the ``examples``
    extra) without importing scikit-learn: its import costs about 2 s of CPU a rank, which
    on 13 ranks of a 2-core machine is most of a short example's run; ``load_digits`` reads
    the same file the same way, and is the fallback should the file move."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package, imports nothing)
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.exists():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    data = load_digits()
    return data.data, data.target


def mlp(hidden: int = 128) -> torch.nn.Module:
    """The same initial weights on every rank (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
