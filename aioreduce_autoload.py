"""Registers the ``torch.distributed`` backend "aioreduce" whenever torch is imported.

torch calls every entry point of the group ``torch.backends`` at the end of ``import torch``
(its device-backend autoload, on unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). This one makes
``init_process_group(backend="aioreduce")`` work in processes that never import aioreduce
themselves, such as Ray Train's workers, whose process group Ray creates before any user code
runs: the user's only change is the backend's name.

It must cost ``import torch`` next to nothing and never raise (an exception would abort the
import): it imports nothing of aioreduce until a process group is created. It is a top-level
module of its own because importing anything under ``aioreduce`` runs the package's
``__init__`` (about 0.1 s).
"""

from __future__ import annotations

from typing import Any

BACKEND = "aioreduce"


def register() -> None:
    """Register the backend with a creator that loads aioreduce on first use."""
    try:
        import torch.distributed as dist
        if dist.is_available() and BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                          devices=["cpu", "cuda"])
    except Exception:  # never break `import torch`
        pass


def _create(*args: Any) -> Any:
    from aioreduce.torch import process_group
    process_group.register()  # the rest of what `import aioreduce.torch` sets up
    return process_group._create(*args)
