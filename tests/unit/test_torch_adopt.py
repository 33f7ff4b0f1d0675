"""The frames by which our process group tells torch's DDP's own collectives
(:mod:`aioreduce.torch.adopt`), in one process: a world-size-1 group records who called each
of its collectives while torch's DDP is built and trained. Fails if a torch version moves
those collectives out of ``__init__`` and ``_pre_forward`` (the adoption would then miss)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

from aioreduce.torch import adopt  # noqa: E402
from aioreduce.torch.ddp_heal import Alone, Iterations, healing_hook  # noqa: E402


class Recording(Alone):
    """Completes every collective here and records (name, what ``_calling_ddp`` found)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def broadcast(self, tensors: list[Any], opts: object = None) -> Any:  # type: ignore[override]
        self.calls.append(("broadcast", adopt._calling_ddp(sys._getframe(1))))
        return super().broadcast(tensors, opts)

    def allgather(self, output_tensors: list[list[Any]], input_tensors: list[Any],  # type: ignore[override]
                  opts: object = None) -> Any:
        self.calls.append(("allgather", adopt._calling_ddp(sys._getframe(1))))
        return super().allgather(output_tensors, input_tensors, opts)


def test_ddp_s_construction_and_forward_collectives_are_told_by_their_frames() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    pg = Recording()
    ddp = TorchDDP(model, process_group=pg)
    # Construction: the shapes' check (allgather) and rank 0's state (broadcasts, a bucket
    # each), each found as this DDP's construction.
    names = [name for name, _ in pg.calls]
    assert names[0] == "allgather" and set(names[1:]) == {"broadcast"}
    assert all(found == (ddp, True) for _, found in pg.calls)
    pg.calls.clear()
    for _ in range(2):  # the second forward broadcasts the rebuilt bucket order
        ddp(torch.randn(5, 4)).sum().backward()
    assert pg.calls, "DDP ran no collective of its own in its forwards"
    assert all(name == "broadcast" and found == (ddp, False) for name, found in pg.calls)
    # A collective of the program's own is nobody's.
    assert adopt._calling_ddp(sys._getframe(0)) is None


class Group(Recording):
    """A stand-in for our group as :func:`adopt.stays_here` sees it (a rank of a job, maybe a
    replacement): its collectives complete here where ``stays_here`` says so, and are
    recorded as "joined" otherwise."""

    def __init__(self, rejoined: bool) -> None:
        super().__init__()
        incarnations = SimpleNamespace(rejoined=rejoined)
        self.node = SimpleNamespace(rank=0, node=SimpleNamespace(
            mesh=SimpleNamespace(incarnations=incarnations)))
        self.joined: list[str] = []

    def broadcast(self, tensors: list[Any], opts: object = None) -> Any:  # type: ignore[override]
        if not adopt.stays_here(self):  # type: ignore[arg-type]
            self.joined.append("broadcast")
        return Alone.broadcast(self, tensors, opts)

    def allgather(self, output_tensors: list[list[Any]], input_tensors: list[Any],  # type: ignore[override]
                  opts: object = None) -> Any:
        if not adopt.stays_here(self):  # type: ignore[arg-type]
            self.joined.append("allgather")
        return Alone.allgather(self, output_tensors, input_tensors, opts)


@pytest.mark.parametrize("rejoined", [False, True])
def test_a_ddp_is_adopted_at_its_first_forward_and_a_replacement_builds_it_alone(
        rejoined: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    pg = Group(rejoined)
    ddp = TorchDDP(model, process_group=pg)
    # A rank that started with the job joins the construction's collectives; a replacement
    # (its parameters healed from a live rank) completes them on its own.
    assert (pg.joined == []) if rejoined else (pg.joined[0] == "allgather")
    assert getattr(ddp, adopt._ADOPTED, "unseen") == "unseen"
    ddp(torch.randn(3, 4))  # (no backward: the hook would sum through a real group)
    iterations = getattr(ddp, adopt._ADOPTED)
    assert isinstance(iterations, Iterations) and iterations.joining is rejoined
    assert ddp._comm_hooks == [(healing_hook, iterations)]


def test_a_ddp_that_cannot_heal_is_left_as_it_is_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = TorchDDP(model, process_group=Group(False), find_unused_parameters=True)
    with caplog.at_level("WARNING", logger="aioreduce.torch"):
        ddp(torch.randn(3, 4))
    assert getattr(ddp, adopt._ADOPTED) is None and not ddp._comm_hooks
    assert "rank 0: DistributedDataParallel with find_unused_parameters=True (the ranks" \
        in caplog.text
