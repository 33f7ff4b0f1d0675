"""``torch.distributed`` backend "aioreduce": a process group whose collectives run on a node.

``import aioreduce.torch`` registers it; then ``dist.init_process_group(backend="aioreduce")``
under torchrun or ``aioreduce-launch`` (both set ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``) makes an otherwise unchanged program (stock DDP included) use our transport.

How a collective runs. Torch calls the process group with the GIL held on the trainer's
thread; each method turns its tensors into numpy views, queues one coroutine on the node's
event loop and returns a ``Work`` at once. The coroutines run one at a time in the order they
were issued, which is the same on every rank, so collectives match by sequence number (the
node's step). A thread of ours (not the event loop's: user callbacks chained on the future
may block) copies each result into the caller's tensors and completes its future.

Sums and averages of floating-point tensors go through the node's scheme (``Ring`` unless
configured: :func:`configure` or ``AIOREDUCE_TORCH_SCHEME``); integers under a bounded-time
scheme, and min, max and product, are gathered and reduced exactly (``Node.allgather``: meant
for the small tensors torch reduces that way).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch._C._distributed_c10d import _create_work_from_future as _work_of  # type: ignore[attr-defined]

from ..env import NodeEnv
from ..errors import ConfigError
from ..node import Node, env_extras
from ..schemes import Result, Scheme, Transpose
from ..schemes.registry import by_name
from ..sync import SyncNode
from .tensors import to_numpy

log = logging.getLogger("aioreduce.torch")

BACKEND = "aioreduce"
_NO_VALUE = np.empty(0, np.float32)
_NO_VALUE.setflags(write=False)
_configured: Scheme | None = None


def configure(scheme: Scheme | None) -> None:
    """The scheme process groups created from now on use for sums (``None``: the default,
    ``AIOREDUCE_TORCH_SCHEME`` or ``Ring()``). Call it before ``init_process_group``."""
    global _configured
    _configured = scheme


def default_scheme() -> Scheme:
    if _configured is not None:
        return _configured
    return by_name(os.environ.get("AIOREDUCE_TORCH_SCHEME", "ring"))


class _Completer:
    """One thread of ours that finishes collectives in issue order: waits for the node's
    result, copies it into the caller's tensors, completes the torch future."""

    def __init__(self, rank: int) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             torch.futures.Future[Any],
                                             Callable[[Any], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"aioreduce-torch-{rank}",
                                        daemon=True)
        self._thread.start()

    def add(self, done: concurrent.futures.Future[Any], fut: torch.futures.Future[Any],
            finish: Callable[[Any], Any]) -> None:
        self._queue.put((done, fut, finish))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._finish(*item)
            # Nothing of it stays bound here while we wait for the next: a result held would
            # keep its memory from being handed out again to the next step.
            del item

    @staticmethod
    def _finish(done: concurrent.futures.Future[Any], fut: torch.futures.Future[Any],
                finish: Callable[[Any], Any]) -> None:
        try:
            value = finish(done.result())
        except BaseException as exc:  # the caller sees it from Work.wait()
            fut.set_exception(exc)
        else:
            fut.set_result(value)


def _work(fut: torch.futures.Future[Any]) -> dist.Work:
    """A ``Work`` that completes with ``fut`` (what ``async_op=True`` hands the caller)."""
    work: dist.Work = _work_of(fut)
    return work


def _reduce_op(opts: object) -> Any:
    """The ``RedOpType`` of ``opts``: an options object (``.reduceOp``), a ``ReduceOp`` or a
    ``RedOpType`` (a ``ReduceOp`` object only compares equal from its own side: unwrap it)."""
    op = getattr(opts, "reduceOp", opts)
    if op is None:
        return dist.ReduceOp.SUM
    return getattr(op, "op", op)


def _sync_back(tensor: torch.Tensor, view: np.ndarray) -> None:
    """``view`` came from :func:`to_numpy`: the tensor's own memory when it is contiguous,
    else a contiguous copy, whose new values go back into the tensor here."""
    if not tensor.is_contiguous():
        tensor.copy_(torch.from_numpy(view).view(tensor.shape))


_LOCAL: dict[Any, Callable[..., Any]] = {
    dist.ReduceOp.MIN: np.min, dist.ReduceOp.MAX: np.max, dist.ReduceOp.PRODUCT: np.prod}


class ProcessGroupAioreduce(dist.ProcessGroup):
    """A ``torch.distributed`` process group over an aioreduce node (every rank of the job).

    Implemented: ``allreduce`` (sum, avg, min, max, product), ``broadcast``, ``allgather``
    (and its flat form), ``reduce_scatter`` (and its flat form), ``reduce``, ``barrier``, sync
    and ``async_op=True``. Anything else raises ``NotImplementedError`` naming it.
    """

    def __init__(self, node: SyncNode, *, owns_node: bool = False) -> None:
        super().__init__(node.rank, node.world_size)  # type: ignore[call-arg]
        self.node = node
        self._owns_node = owns_node
        self._completer = _Completer(node.rank)
        # Of the sums since the last take_results(), without their values (the values live in
        # the caller's tensors; a kept value would also keep its buffer from the scheme's pool,
        # so every step would fault in fresh memory: 2.5x the time of a 9.6 MB ring sum).
        self.last_results: list[Result] = []
        self.needs_resync = False  # a bounded-time sum asked for a re-sync of the replicas

    # -- torch's questions -------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self.node.world_size

    def rank(self) -> int:
        return self.node.rank

    def __repr__(self) -> str:
        return f"ProcessGroupAioreduce(rank={self.node.rank}, size={self.node.world_size})"

    # -- machinery -----------------------------------------------------------------------------
    def _queue(self, make: Callable[[], Coroutine[Any, Any, Any]],
               finish: Callable[[Any], Any]) -> torch.futures.Future[Any]:
        """Queue ``make()`` on the node's loop after every collective issued before it; a
        torch future of ``finish(its result)``, completed by our thread."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self._completer.add(self.node.submit_in_order(make), fut, finish)
        return fut

    def _issue(self, make: Callable[[], Coroutine[Any, Any, Any]],
               finish: Callable[[Any], Any]) -> dist.Work:
        """:meth:`_queue` as the ``Work`` a collective returns."""
        return _work(self._queue(make, finish))

    def future_sum(self, tensor: torch.Tensor, *, average: bool,
                   on_result: Callable[[Result], None] | None = None
                   ) -> torch.futures.Future[Any]:
        """The sum (or mean) of ``tensor`` over the ranks, written into ``tensor``; a torch
        future of it (the DDP hook hands this one back to DDP). ``on_result`` gets the step's
        :class:`~aioreduce.Result` first (on our completing thread)."""
        arr = to_numpy(tensor, self.node.rank)
        node = self.node.node
        in_place = arr.dtype.kind == "f"  # sum into the tensor's own memory, as Gloo does
        divided = False

        async def total() -> Result:
            nonlocal divided
            if not in_place:
                return await node.allreduce(arr, any_shape=True)
            # The ring divides as it goes (1/N of the vector), saving a pass at the end.
            divided = average and node.sums_in_place
            return await node.allreduce(arr, op="mean" if divided else "sum", any_shape=True,
                                        in_place=True)

        def finish(res: Result) -> torch.Tensor:
            self._note(res)
            if on_result is not None:
                on_result(res)
            if average and not divided:
                np.divide(res.value, self.node.world_size, out=arr, casting="unsafe")
            elif not in_place:
                np.copyto(arr, res.value, casting="unsafe")
            _sync_back(tensor, arr)
            return tensor

        return self._queue(total, finish)

    def _note(self, res: Result) -> None:
        self.last_results.append(dataclasses.replace(res, value=_NO_VALUE))
        del self.last_results[:-1024]  # bounded when nobody takes them
        if res.resync and res.drifted:
            self.needs_resync = True

    def take_results(self) -> list[Result]:
        """The results of the sums since the last call (for commit policies), each with an
        empty ``value``: the sums themselves are in the tensors they were asked for."""
        out, self.last_results = self.last_results, []
        return out

    def _exact_sum_only(self, arr: np.ndarray) -> bool:
        """Integers under a scheme that may drop data are summed exactly by gathering."""
        return arr.dtype.kind != "f" and isinstance(self.node.node.scheme, Transpose)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        op = _reduce_op(opts)
        node = self.node.node
        arr = to_numpy(tensor, node.rank)
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and not self._exact_sum_only(arr):
            average = op == dist.ReduceOp.AVG
            fut = self.future_sum(tensor, average=average)
            return _work(fut.then(lambda f: [f.value()]))
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            local: Callable[..., Any] = np.sum
        elif op in _LOCAL:
            local = _LOCAL[op]
        else:
            raise NotImplementedError(f"aioreduce: all_reduce with {op} is not implemented "
                                      "(sum, avg, min, max and product are)")

        def finish(res: Result) -> list[torch.Tensor]:
            out = local(res.value, axis=0)
            if op == dist.ReduceOp.AVG:
                out = out / node.world_size
            np.copyto(arr, out, casting="unsafe")
            _sync_back(tensor, arr)
            return [tensor]

        return self._issue(lambda: node.allgather(arr), finish)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        root = int(getattr(opts, "rootRank", 0))
        node = self.node.node
        arr = to_numpy(tensor, node.rank)

        def finish(res: Result) -> list[torch.Tensor]:
            if node.rank != root:
                np.copyto(arr, res.value)
                _sync_back(tensor, arr)
            return [tensor]

        return self._issue(lambda: node.broadcast(arr, root), finish)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        (outs,), (tensor,) = output_tensors, input_tensors
        node = self.node.node
        arr = to_numpy(tensor, node.rank)
        if len(outs) != node.world_size:
            raise ValueError(f"rank {node.rank}: all_gather needs {node.world_size} output "
                             f"tensors, got {len(outs)}")
        views = [to_numpy(t, node.rank) for t in outs]

        def finish(res: Result) -> list[list[torch.Tensor]]:
            for r, view in enumerate(views):
                np.copyto(view, res.value[r].reshape(view.shape))
                _sync_back(outs[r], view)
            return [outs]

        return self._issue(lambda: node.allgather(arr), finish)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                        opts: object = None) -> dist.Work:
        chunks = list(output.view(self.node.world_size, -1))
        return self.allgather([chunks], [input.reshape(-1)], opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: object = None
                       ) -> dist.Work:
        (out,), (ins,) = output_tensors, input_tensors
        op = _reduce_op(opts)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"aioreduce: reduce_scatter with {op} is not implemented "
                                      "(sum and avg are)")
        flat = torch.cat([t.reshape(-1) for t in ins])
        me = self.node.rank
        lo = sum(t.numel() for t in ins[:me])
        fut = self.future_sum(flat, average=op == dist.ReduceOp.AVG)

        def take(f: torch.futures.Future[Any]) -> list[torch.Tensor]:
            out.copy_(f.value()[lo:lo + out.numel()].view_as(out))
            return [out]

        return _work(fut.then(take))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                             opts: object = None) -> dist.Work:
        return self.reduce_scatter([output], [list(input.view(self.node.world_size, -1))], opts)

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        root = int(getattr(opts, "rootRank", 0))
        keep = tensor if self.node.rank == root else tensor.clone()  # only the root's changes
        return self.allreduce([keep], opts)

    def barrier(self, opts: object = None) -> dist.Work:
        node = self.node.node
        return self._issue(lambda: node.barrier(), lambda _none: [])

    def _not_implemented(self, what: str) -> dist.Work:
        raise NotImplementedError(f"aioreduce: {what} is not implemented by the aioreduce "
                                  "backend (all_reduce, broadcast, all_gather, reduce_scatter, "
                                  "reduce and barrier are)")

    def send(self, *args: object) -> dist.Work:
        return self._not_implemented("send")

    def recv(self, *args: object) -> dist.Work:
        return self._not_implemented("recv")

    def recv_anysource(self, *args: object) -> dist.Work:
        return self._not_implemented("recv from any source")

    def gather(self, *args: object) -> dist.Work:
        return self._not_implemented("gather")

    def scatter(self, *args: object) -> dist.Work:
        return self._not_implemented("scatter")

    def alltoall(self, *args: object) -> dist.Work:
        return self._not_implemented("all_to_all")

    def all_to_all_single(self, *args: object) -> dist.Work:
        return self._not_implemented("all_to_all_single")

    def allreduce_coalesced(self, *args: object) -> dist.Work:
        return self._not_implemented("all_reduce_coalesced")

    def allgather_coalesced(self, *args: object) -> dist.Work:
        return self._not_implemented("all_gather_coalesced")

    def shutdown(self) -> None:
        """Stop the completer thread; close the node when this group made it."""
        self._completer.stop()
        if self._owns_node:
            self.node.close()


def _node_from_store(store: Store, rank: int, world_size: int, timeout: timedelta,
                     scheme: Scheme | None = None) -> SyncNode:
    """Rendezvous through torch's store: rank 0 listens on a free port and publishes its
    address, the job's secret (unless ``AIOREDUCE_SECRET`` is set everywhere) and a job id.
    ``AIOREDUCE_STRAGGLE`` injects stragglers as for any node."""
    env = os.environ
    host = env.get("AIOREDUCE_MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1"
    # AIOREDUCE_STRAGGLE, _LATENCY, _TRACE, _GC_EVERY: as Node.from_env reads them.
    extra: dict[str, Any] = env_extras(env)
    if rank == 0:
        secret = env.get("AIOREDUCE_SECRET") or secrets.token_hex(32)
        job = env.get("AIOREDUCE_JOB") or secrets.token_hex(8)
        if not env.get("AIOREDUCE_SECRET"):
            store.set("aioreduce/secret", secret)
        store.set("aioreduce/job", job)

        def publish(addr: str, port: int) -> None:
            store.set("aioreduce/master", f"{addr} {port}")

        extra["on_listen"] = publish
        addr, port = host, 0
    else:
        addr, port_text = store.get("aioreduce/master").decode().rsplit(" ", 1)
        port = int(port_text)
        secret = env.get("AIOREDUCE_SECRET") or store.get("aioreduce/secret").decode()
        job = store.get("aioreduce/job").decode()
    node_env = NodeEnv(rank, world_size, addr, port, secret.encode(), job,
                       advertise_addr=env.get("AIOREDUCE_ADDR") or None,
                       bind_addr=env.get("AIOREDUCE_BIND") or None,
                       rendezvous_timeout=timeout.total_seconds(), source="torch")
    return SyncNode(Node(node_env, scheme=scheme or default_scheme(), **extra), timeout=None)


def connect(scheme: Scheme | None = None, *, timeout: float = 300.0) -> SyncNode:
    """A blocking node (as :func:`aioreduce.connect`) that meets its peers through a torch
    ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``, as torchrun and aioreduce-launch set them: no
    job secret to distribute (rank 0 makes one and hands it over the store). Not together with
    ``init_process_group`` on the same port; with a process group of ours, use its ``.node``."""
    env = os.environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except KeyError as exc:
        raise ConfigError(f"aioreduce.torch.connect needs {exc.args[0]} (run under torchrun or "
                          "aioreduce-launch)") from None
    wait = timedelta(seconds=timeout)
    store = TCPStore(host, port, world, rank == 0, wait)
    node = _node_from_store(PrefixStore("aioreduce-connect", store), rank, world, wait, scheme)
    node.keepalive = store  # rank 0 serves the store; it lives as long as the node
    return node


def _create(store: Store, rank: int, world_size: int,
            timeout: timedelta) -> ProcessGroupAioreduce:
    return ProcessGroupAioreduce(_node_from_store(store, rank, world_size, timeout),
                                 owns_node=True)


def register() -> None:
    """Register backend "aioreduce" with ``torch.distributed`` (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
