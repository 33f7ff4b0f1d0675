"""Ray Train with ``TorchConfig(backend="aioreduce")`` on a local Ray cluster (its own GCS,
raylet and worker processes, on 127.0.0.1): ``examples/ray_train.py`` over Gloo and over
aioreduce, 3 workers, ends at the same loss. The workers never import aioreduce before Ray
creates their process group: torch's backend autoload must have registered it. (One worker
count: a fit is mostly Ray Train's own start-up, about 30 s on a 2-core machine, and what is
tested does not depend on the count.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .harness import HERE

pytest.importorskip("torch")
pytest.importorskip("ray.train", reason="ray[train] is not installed (CI installs it)")
pytestmark = pytest.mark.loopback

EXAMPLE = HERE.parent.parent / "examples" / "ray_train.py"


def test_ray_train_over_aioreduce_reaches_gloos_loss() -> None:
    # Both fits in one Ray session (the example's comma-separated backends): Ray's start-up
    # once.
    out = subprocess.run([sys.executable, str(EXAMPLE), "--workers", "3", "--epochs", "3",
                          "--backend", "gloo,aioreduce"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    gloo, ours = (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    assert ours["backend"] == "aioreduce" and gloo["backend"] == "gloo"
    assert abs(float(ours["loss"]) - float(gloo["loss"])) <= 1e-4 * float(gloo["loss"])
    assert float(ours["accuracy"]) > 0.9
