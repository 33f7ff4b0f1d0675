"""Ray Train over aioreduce: the one change is the backend's name.

    python examples/ray_train.py --workers 2                   # a local Ray, backend aioreduce
    python examples/ray_train.py --workers 2 --backend gloo    # the same run over Gloo
    python examples/ray_train.py --backend gloo,aioreduce      # both, one after the other
    RAY_ADDRESS=HEAD:6379 python examples/ray_train.py          # a cluster from `ray start`

``TorchTrainer(train, torch_config=TorchConfig(backend="aioreduce"), ...)``: Ray creates the
process group in every worker before the training function runs; installing aioreduce is
enough for its workers to know the backend (torch loads it when it is imported, see
``aioreduce_autoload``). The training function is plain Ray Train: an MLP on scikit-learn's
digits (read once by the driver, ``examples/digits.py``, and handed to the workers with their
config), wrapped in DDP by ``ray.train.torch.prepare_model``, each worker on its own share of
every epoch. Several backends (comma-separated) are fitted one after the other in the same
Ray session. For each it prints the last epoch's mean loss over the workers and the test
accuracy, then a JSON line (``{"backend", "loss", "accuracy"}``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any


def train(config: dict[str, Any]) -> None:
    """One Ray Train worker (self-contained: Ray ships it to the workers by value)."""
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    train_x, train_y, test_x, test_y = (torch.tensor(a) for a in config["data"])
    cut = len(train_y)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = 32
    for epoch in range(config["epochs"]):
        perm = torch.from_numpy(np.random.default_rng(100 + epoch).permutation(cut))
        mine = perm[rank::world]
        losses = []
        for i in range(0, len(mine) - batch + 1, batch):
            idx = mine[i:i + batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        mean = torch.tensor([float(np.mean(losses))])
        dist.all_reduce(mean)
        with torch.no_grad():
            acc = float((model(test_x).argmax(1) == test_y).float().mean())
        metrics = {"epoch": epoch, "loss": float(mean) / world, "accuracy": acc,
                   "backend": dist.get_backend()}
        if epoch + 1 < config["epochs"]:
            ray.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as tmp:  # the result keeps the last report's
            checkpoint = None                       # metrics with its checkpoint
            if rank == 0:
                torch.save(model.state_dict(), f"{tmp}/model.pt")
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--backend", default="aioreduce",
                    help="aioreduce (default), gloo, or several comma-separated")
    a = ap.parse_args()
    import ray
    from digits import digits  # (examples/, beside this file)

    # Joins RAY_ADDRESS's cluster if set; a local one otherwise, on 127.0.0.1 (the workers'
    # MASTER_ADDR, where the process group meets, is this node's address).
    if os.environ.get("RAY_ADDRESS"):  # your cluster
        ray.init(log_to_driver=False)
    else:
        ray.init(num_cpus=max(a.workers, 2), include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    data = [t.numpy() for t in digits()]  # read here once, not by every worker
    try:
        for backend in a.backend.split(","):
            _fit(a.workers, a.epochs, backend, data)
    finally:
        ray.shutdown()


def _fit(workers: int, epochs: int, backend: str, data: list[Any]) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            train, train_loop_config={"epochs": epochs, "data": data},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
            torch_config=TorchConfig(backend=backend),
            run_config=RunConfig(storage_path=storage, name=f"aioreduce-example-{backend}"))
        result = trainer.fit()
    if result.error is not None:
        raise result.error
    m = result.metrics
    print(f"{workers} workers over {m['backend']}: loss {m['loss']:.4f}, "
          f"test accuracy {m['accuracy']:.3f} after {m['epoch'] + 1} epochs", flush=True)
    print(json.dumps({"backend": m["backend"], "loss": m["loss"], "accuracy": m["accuracy"]}),
          flush=True)


if __name__ == "__main__":
    main()
