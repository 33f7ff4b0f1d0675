"""``torch.distributed`` backend "aioreduce": a process group whose collectives run on a node.

``import aioreduce.torch`` registers it; then ``dist.init_process_group(backend="aioreduce")``
under torchrun, ``aioreduce-launch`` or Ray Train makes an otherwise unchanged program (stock DDP,
FSDP2, DeviceMesh, point-to-point calls included) use our transport, with CPU or CUDA tensors.

How a call runs. Torch calls the process group with the GIL held on the trainer's thread. Each
method stages its tensors as host bytes (:mod:`.staging`: a CPU tensor's own memory, a GPU
tensor's copy in a reused pinned buffer, made on a side stream), queues one coroutine on the
node's event loop and returns a ``Work`` at once. Collectives run one at a time in the order
they were issued, which is the same on every rank, so they match by the node's step.
Point-to-point calls are numbered per peer and tag when issued (:mod:`aioreduce.schemes.p2p`)
and run beside the collectives, never in their order. A thread of ours (:mod:`.completer`)
copies results back (on the side stream) and completes the torch futures.

What reduces how. Sums and averages of float32 and float64 tensors go through the node's scheme
(``Ring`` unless configured: :func:`configure` or ``AIOREDUCE_TORCH_SCHEME``). Everything else
is reduced exactly by the owners of its parts (:mod:`.direct`): 16-bit floats carried in 16 bits
and accumulated in float32, integers, min, max, product, bitwise ops, and every
``reduce_scatter``.

Where ranks may die and come back (``rejoin_wait`` > 0), torch's own DDP built over a group of
ours heals as our wrapper does: the group adopts it (:mod:`.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from ..env import NodeEnv
from ..errors import ConfigError
from ..heal import StateHooks
from ..node import Node
from ..schemes import Result, Scheme
from ..schemes.base import ReadsInOrder, SumsInPlace
from ..schemes.registry import by_name
from ..settings import env_extras
from ..sync import SyncNode
from ..sync import connect as connect_env
from ..tensors import check_tensor
from . import adopt, direct
from .completer import Completer, Context
from .staging import Staged, Stager
from .work import FutureWork, as_work, completed

log = logging.getLogger("aioreduce.torch")

BACKEND = "aioreduce"
_NO_VALUE = np.empty(0, np.float32)
_NO_VALUE.setflags(write=False)
_configured: Scheme | None = None
_state: StateHooks | None = None
_SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


# A device tensor at least this large is copied to the host in the pieces its sum reads
# first (smaller ones in one copy: a copy's launch costs more than the overlap buys).
PIECES_FROM = 1 << 20


def configure(scheme: Scheme | None = None, *, state: StateHooks | None = None) -> None:
    """Settings of the process groups created from now on; call it before
    ``init_process_group``. ``scheme``: what sums (``None``: the default,
    ``AIOREDUCE_TORCH_SCHEME`` or ``Ring()``). ``state``: how a replacement of this rank
    heals (:func:`aioreduce.torch.state_hooks`), carried by the group over the whole job
    (the default group): a replacement started by ``aioreduce-launch --restart`` rejoins
    the running job and loads the state a live rank sends (see :mod:`aioreduce.heal`).
    Each call sets both."""
    global _configured, _state
    _configured, _state = scheme, state


def default_scheme() -> Scheme:
    if _configured is not None:
        return _configured
    return by_name(os.environ.get("AIOREDUCE_TORCH_SCHEME", "ring"))


def _after_all(futs: list[torch.futures.Future[Any]], value: Any) -> torch.futures.Future[Any]:
    """A future of ``value`` once every one of ``futs`` (collectives issued in this order) is
    done, failing with the first failure. Chained on the last one, not ``collect_all``: the
    collectives complete in issue order, and a future chained on a device-aware future stays
    device-aware (``collect_all``'s does not, so a caller's stream could read a result before
    the copy back of an earlier collective landed)."""
    def check(_last: torch.futures.Future[Any]) -> Any:
        for f in futs:
            f.value()
        return value

    return futs[-1].then(check)


def _reduce_op(opts: object) -> Any:
    """The ``RedOpType`` of ``opts``: an options object (``.reduceOp``), a ``ReduceOp`` or a
    ``RedOpType`` (a ``ReduceOp`` object only compares equal from its own side: unwrap it)."""
    op = getattr(opts, "reduceOp", opts)
    if op is None:
        return dist.ReduceOp.SUM
    return getattr(op, "op", op)


def _root(opts: object) -> int:
    return int(getattr(opts, "rootRank", 0))


def _rows(t: torch.Tensor, splits: Sequence[int], world: int, rank: int, what: str
          ) -> list[int]:
    """Element offsets of the dim-0 row blocks ``splits`` of ``t`` (even when empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % world:
            raise ValueError(f"rank {rank}: all_to_all_single: {what} has {rows} rows, not "
                             f"a multiple of the world size {world}; pass split sizes")
        splits = [rows // world] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"rank {rank}: all_to_all_single: {what} split sizes {list(splits)} "
                         f"must be {world} sizes adding up to its {rows} rows")
    per_row = t.numel() // rows if rows else 0
    edges = [0]
    for n in splits:
        edges.append(edges[-1] + n * per_row)
    return edges


class ProcessGroupAioreduce(dist.ProcessGroup):
    """A ``torch.distributed`` process group over an aioreduce node.

    Collectives: ``allreduce`` (sum, avg, min, max, product, bitwise) and its coalesced
    form, ``broadcast``, ``allgather`` (list, flat and coalesced), ``reduce_scatter`` (list,
    flat and coalesced), ``reduce``, ``gather``, ``scatter``, ``alltoall``,
    ``all_to_all_single`` (with split sizes), ``barrier``, ``monitored_barrier``.
    Point-to-point: ``send``, ``recv`` (``isend``/``irecv``/``batch_isend_irecv`` through
    torch). CPU and CUDA tensors; float64/32/16, bfloat16, integers and bool. Not:
    ``recv`` from any source, ``PREMUL_SUM``.
    """

    def __init__(self, node: SyncNode, *, owns_node: bool = False,
                 staging_limit: int = 256 << 20) -> None:
        super().__init__(node.rank, node.world_size)  # type: ignore[call-arg]
        self.node = node
        self._owns_node = owns_node
        self._completer = Completer(node.rank)
        self.stager = Stager(staging_limit)
        self._group_name = ""
        self._group_desc = ""
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

    # DeviceMesh and FSDP2 find groups by name. The C++ base keeps a name only for a C++
    # backend, so a Python group keeps its own: torch >= 2.13 forwards getGroupName and
    # friends to these methods; older versions call _set_group_name and read group_name.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return (f"ProcessGroupAioreduce(rank={self.node.rank}, size={self.node.world_size}, "
                f"name={self._group_name!r})")

    # -- machinery -----------------------------------------------------------------------------
    def _check(self, t: object) -> torch.Tensor:
        return check_tensor(t, self.node.rank)

    def _stage(self, t: object, *, read: bool = True) -> Staged:
        return self.stager.stage(self._check(t), read=read)

    def _op(self, staged: Sequence[Staged], outputs: Sequence[Staged],
            body: Callable[[], Coroutine[Any, Any, Any]], value: Callable[[Any], Any], *,
            ordered: bool = True, landing: bool = False) -> torch.futures.Future[Any]:
        """Run ``body()`` on the node's loop once every staged input is on the host (at once
        with ``landing``: the body waits for the pieces it reads itself), after the
        collectives issued before it when ``ordered``; then, on our thread, copy the
        ``outputs`` back and complete the returned future with ``value(body's result)``."""
        on_device = next((s for s in staged if s.stream is not None), None)
        fut: torch.futures.Future[Any] = (
            torch.futures.Future() if on_device is None
            else torch.futures.Future(devices=[on_device.tensor.device]))

        async def run() -> Any:
            for s in () if landing else staged:
                if s.ready is not None and not s.ready.query():
                    await asyncio.get_running_loop().run_in_executor(None, s.ready.synchronize)
            return await body()

        def finish(result: Any) -> Any:
            try:
                out = value(result)
                for s in outputs:
                    s.write_back()
            finally:
                for s in staged:
                    s.release()
            return out

        context: Context = contextlib.nullcontext
        if on_device is not None:
            side = on_device.stream
            context = lambda: torch.cuda.stream(side)  # noqa: E731
        done = (self.node.submit_in_order(run) if ordered else self.node.submit(run()))
        self._completer.add(done, fut, finish, context)
        return fut

    def _issue(self, staged: Sequence[Staged], outputs: Sequence[Staged],
               body: Callable[[], Coroutine[Any, Any, Any]], value: Any, *,
               ordered: bool = True) -> dist.Work:
        """:meth:`_op` as the ``Work`` a call returns, completing with ``value``."""
        return as_work(self._op(staged, outputs, body, lambda _r: value, ordered=ordered))

    def future_sum(self, tensor: torch.Tensor, *, average: bool,
                   on_result: Callable[[Result], None] | None = None, rerun: bool = True,
                   last: bool = False) -> torch.futures.Future[Any]:
        """The sum (or mean) of ``tensor`` over the ranks, written into ``tensor``; a torch
        future of it (the DDP hook hands this one back to DDP). ``on_result`` gets the step's
        :class:`~aioreduce.Result` first (on our completing thread). ``rerun=False``: one of
        a group of sums the caller runs again as a whole (see ``Node.replace_lost``);
        ``last``: the group's last (see ``Node.allreduce``)."""
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        return self._allreduce(tensor, op, on_result, rerun, last)

    def _allreduce(self, tensor: torch.Tensor, op: Any,
                   on_result: Callable[[Result], None] | None = None, rerun: bool = True,
                   last: bool = False) -> torch.futures.Future[Any]:
        node = self.node.node
        tensor = self._check(tensor)
        by_owners = op not in _SUMS or tensor.dtype not in (torch.float32, torch.float64)
        if by_owners:  # named before anything is staged
            self._check_op(op, "all_reduce")
        session = node.session
        # A device tensor is copied to the host in the order the session reads it, so the
        # sum starts once the first piece is in, and comes back piece by piece as each is
        # final (a session that sums in place says when).
        streams = (not by_owners and tensor.is_cuda and tensor.is_contiguous()
                   and isinstance(session, SumsInPlace))
        order = (session.read_order(tensor.numel())
                 if streams and isinstance(session, ReadsInOrder)
                 and tensor.numel() * tensor.element_size() >= PIECES_FROM else ())
        st = self.stager.stage(tensor, order=order)
        host, dtype, world = st.host, st.tensor.dtype, node.world_size
        if by_owners:
            back = st if tensor.is_contiguous() else None  # each part copied back as it comes
            return self._op([st], [st], lambda: direct.allreduce(node, host, dtype, op, back),
                            lambda _r: tensor)
        average = op == dist.ReduceOp.AVG
        divided = average and node.sums_in_place  # the ring divides as it goes

        async def total() -> Result:
            return await node.allreduce(host, op="mean" if divided else "sum",
                                        any_shape=True, in_place=True,
                                        arrival=st if streams else None, rerun=rerun,
                                        last=last)

        def value(res: Result) -> torch.Tensor:
            self._note(res)
            if on_result is not None:
                on_result(res)
            if average and not divided:
                np.divide(host, world, out=host)
            return tensor

        return self._op([st], [st], total, value, landing=streams)

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

    def _exchange(self, staged: Sequence[Staged], outputs: Sequence[Staged],
                  sends: dict[int, np.ndarray], recvs: dict[int, np.ndarray],
                  value: Any) -> dist.Work:
        """One exchange step (:meth:`aioreduce.Node.exchange`) as a ``Work``."""
        node = self.node.node
        return self._issue(staged, outputs, lambda: node.exchange(sends, recvs), value)

    def _peers(self) -> list[int]:
        return [r for r in range(self.node.world_size) if r != self.node.rank]

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.node.world_size:
            raise ValueError(f"rank {self.node.rank}: {what} root {root} is not a rank of "
                             f"this group (size {self.node.world_size})")

    def _check_op(self, op: Any, what: str) -> None:
        """A reduction the owners cannot apply, named before anything is staged."""
        if not direct.supported(op):
            raise NotImplementedError(f"rank {self.node.rank}: {what} with {op} is not "
                                      "implemented by aioreduce")

    def _check_count(self, tensors: Sequence[object], what: str) -> None:
        if len(tensors) != self.node.world_size:
            raise ValueError(f"rank {self.node.rank}: {what} needs {self.node.world_size} "
                             f"tensors, got {len(tensors)}")

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        fut = self._allreduce(tensor, _reduce_op(opts))
        return as_work(fut.then(lambda f: [f.value()]))

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: object = None) -> dist.Work:
        """One reduction per dtype of the tensors, flattened together."""
        op = _reduce_op(opts)
        futs = []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            futs.append(self._flat_allreduce(group, op))
        return as_work(_after_all(futs, tensors))

    def _flat_allreduce(self, group: list[torch.Tensor], op: Any) -> torch.futures.Future[Any]:
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        fut = self._allreduce(flat, op)

        def scatter_back(f: torch.futures.Future[Any]) -> list[torch.Tensor]:
            f.value()
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            return group

        return fut.then(scatter_back)

    def _ddp_own(self) -> bool:
        """Whether the collective being called is one of torch's DDP's own that completes on
        this rank, in a job whose ranks may come back (see :mod:`.adopt`)."""
        return self.node.node.healer.rejoin_wait > 0 and adopt.stays_here(self)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        root, me = _root(opts), self.node.rank
        self._check_root(root, "broadcast")
        if self._ddp_own():  # (every rank holds its own: nothing to copy)
            return completed(tensors)
        staged = [self._stage(t, read=me == root) for t in tensors]
        node = self.node.node

        async def body() -> None:
            for s in staged:  # one step per tensor (torch passes one)
                if me == root:
                    await node.exchange({r: s.host for r in self._peers()}, {})
                else:
                    await node.exchange({}, {root: s.host})

        return self._issue(staged, [] if me == root else staged, body, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        (outs,), (tensor,) = output_tensors, input_tensors
        self._check_count(outs, "all_gather")
        if self._ddp_own():  # as if every rank held this one's
            for out in outs:
                out.copy_(tensor)
            return completed(output_tensors)
        inp = self._stage(tensor)
        got = [self._stage(t, read=False) for t in outs]
        return self._exchange([inp, *got], got, {r: inp.host for r in range(len(got))},
                              {r: g.host for r, g in enumerate(got)}, output_tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: object = None) -> dist.Work:
        world = self.node.world_size
        if output.numel() != world * input.numel():  # checked before anything is staged
            raise ValueError(f"rank {self.node.rank}: all_gather_into_tensor needs an output "
                             f"of {world} x {input.numel()} elements, got {output.numel()}")
        out = self._stage(output, read=False)
        inp = self._stage(input)
        n = inp.host.size
        parts = {r: out.host[r * n:(r + 1) * n] for r in range(world)}
        return self._exchange([inp, out], [out], {r: inp.host for r in range(world)}, parts,
                              output)

    _allgather_base = all_gather_single  # torch < 2.12 name

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: object = None
                                    ) -> dist.Work:
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._all_of(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: object = None) -> dist.Work:
        works = [self.allgather([outs], [t]) for outs, t in zip(output_lists, input_list,
                                                                strict=True)]
        return self._all_of(works, output_lists)

    @staticmethod
    def _all_of(works: list[dist.Work], value: Any) -> dist.Work:
        return as_work(_after_all([w.get_future() for w in works], value))

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: object = None
                       ) -> dist.Work:
        (out,), (ins,) = output_tensors, input_tensors
        self._check_count(ins, "reduce_scatter")
        self._check_op(_reduce_op(opts), "reduce_scatter")
        if ins[self.node.rank].numel() != out.numel():
            raise ValueError(f"rank {self.node.rank}: reduce_scatter: the output has "
                             f"{out.numel()} elements, this rank's input part "
                             f"{ins[self.node.rank].numel()}")
        staged = [self._stage(t) for t in ins]
        res = self._stage(out, read=False)
        return self._reduce_scatter([s.host for s in staged], res, [*staged, res],
                                    _reduce_op(opts), output_tensors)

    def _reduce_scatter(self, parts: list[np.ndarray], out: Staged, staged: list[Staged],
                        op: Any, value: Any) -> dist.Work:
        node, dtype = self.node.node, out.tensor.dtype
        return self._issue(staged, [out],
                           lambda: direct.reduce_scatter(node, parts, out.host, dtype, op), value)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: object = None) -> dist.Work:
        world = self.node.world_size
        if input.numel() != world * output.numel():
            raise ValueError(f"rank {self.node.rank}: reduce_scatter_tensor needs an input of "
                             f"{world} x {output.numel()} elements, got {input.numel()}")
        self._check_op(_reduce_op(opts), "reduce_scatter_tensor")
        inp = self._stage(input)
        out = self._stage(output, read=False)
        n = out.host.size
        parts = [inp.host[r * n:(r + 1) * n] for r in range(world)]
        return self._reduce_scatter(parts, out, [inp, out], _reduce_op(opts), output)

    # torch < 2.12 name
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: object = None
                                        ) -> dist.Work:
        works = [self.reduce_scatter_single(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._all_of(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        (tensor,) = tensors
        root = _root(opts)
        self._check_root(root, "reduce")
        keep = tensor if self.node.rank == root else tensor.clone()  # only the root's changes
        return self.allreduce([keep], opts)

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        (tensor,) = input_tensors
        root, me = _root(opts), self.node.rank
        self._check_root(root, "gather")
        inp = self._stage(tensor)
        if me != root:
            return self._exchange([inp], [], {root: inp.host}, {}, output_tensors)
        (outs,) = output_tensors
        self._check_count(outs, "gather")
        got = [self._stage(t, read=False) for t in outs]
        return self._exchange([inp, *got], got, {me: inp.host},
                              {r: g.host for r, g in enumerate(got)}, output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: object = None) -> dist.Work:
        (tensor,) = output_tensors
        root, me = _root(opts), self.node.rank
        self._check_root(root, "scatter")
        out = self._stage(tensor, read=False)
        if me != root:
            return self._exchange([out], [out], {}, {root: out.host}, output_tensors)
        (ins,) = input_tensors
        self._check_count(ins, "scatter")
        staged = [self._stage(t) for t in ins]
        return self._exchange([*staged, out], [out], {r: s.host for r, s in enumerate(staged)},
                              {me: out.host}, output_tensors)

    def alltoall(self, output_tensors: list[torch.Tensor],
                 input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        self._check_count(output_tensors, "all_to_all")
        self._check_count(input_tensors, "all_to_all")
        ins = [self._stage(t) for t in input_tensors]
        outs = [self._stage(t, read=False) for t in output_tensors]
        return self._exchange([*ins, *outs], outs, {r: s.host for r, s in enumerate(ins)},
                              {r: s.host for r, s in enumerate(outs)}, output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] = (),
                          input_split_sizes: Sequence[int] = (), opts: object = None
                          ) -> dist.Work:
        me, world = self.node.rank, self.node.world_size
        out_edges = _rows(output, output_split_sizes, world, me, "the output")
        in_edges = _rows(input, input_split_sizes, world, me, "the input")
        inp = self._stage(input)
        out = self._stage(output, read=False)
        sends = {r: inp.host[in_edges[r]:in_edges[r + 1]] for r in range(world)}
        recvs = {r: out.host[out_edges[r]:out_edges[r + 1]] for r in range(world)}
        return self._exchange([inp, out], [out], sends, recvs, output)

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch < 2.12 name

    def barrier(self, opts: object = None) -> dist.Work:
        node = self.node.node
        return self._issue([], [], lambda: node.barrier(), [])

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it within ``timeout``
        (``dist.monitored_barrier`` reaches it through :func:`register`)."""
        seconds = 1800.0 if timeout is None else timeout.total_seconds()
        node = self.node.node
        self._issue([], [], lambda: node.barrier(seconds), []).wait()

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0
             ) -> dist.Work:
        (tensor,) = tensors
        p2p = self.node.node.p2p
        key = p2p.send_key(dstRank, tag)
        st = self._stage(tensor)
        return self._issue([st], [], lambda: p2p.send(dstRank, key, st.host), tensors,
                           ordered=False)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0
             ) -> dist.Work:
        (tensor,) = tensors
        p2p = self.node.node.p2p
        key = p2p.recv_key(srcRank, tag)
        st = self._stage(tensor, read=False)

        async def body() -> None:
            await p2p.recv(srcRank, key, st.host)

        return self._issue([st], [st], body, tensors, ordered=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """``recv`` without ``src``: the next message with ``tag`` from whichever rank's
        comes first (:meth:`PointToPoint.recv_any`); the work's ``_source_rank()`` names it."""
        (tensor,) = tensors
        p2p = self.node.node.p2p
        st = self._stage(tensor, read=False)
        source: list[int] = []

        async def body() -> int:
            return await p2p.recv_any(tag, st.host)

        def done(src: int) -> list[torch.Tensor]:
            source.append(src)
            return tensors

        return FutureWork(self._op([st], [st], body, done, ordered=False), source)

    def shutdown(self) -> None:
        """Stop the completer thread; close the node when this group made it."""
        self._completer.stop()
        if self._owns_node:
            self.node.close()


def _node_from_store(store: Store, rank: int, world_size: int, timeout: timedelta,
                     scheme: Scheme | None = None, state: StateHooks | None = None
                     ) -> SyncNode:
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
    return SyncNode(Node(node_env, scheme=scheme or default_scheme(), state=state, **extra),
                    timeout=None)


def connect(scheme: Scheme | None = None, *, timeout: float = 300.0,
            state: StateHooks | None = None) -> SyncNode:
    """A blocking node (as :func:`aioreduce.connect`) that meets its peers through a torch
    ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT``, as torchrun and aioreduce-launch set them: no
    job secret to distribute (rank 0 makes one and hands it over the store). Not together with
    ``init_process_group`` on the same port; with a process group of ours, use its ``.node``.
    ``state``: how a replacement of a dead rank heals (:func:`aioreduce.torch.state_hooks`).

    Under aioreduce-launch (``AIOREDUCE_SECRET`` and ``AIOREDUCE_MASTER_PORT`` are set) the
    ranks need no store: they meet as :func:`aioreduce.connect` does, and a rank that the
    launcher restarts rejoins the same way (a late client of rank 0's store was not served)."""
    env = os.environ
    if env.get("AIOREDUCE_SECRET") and env.get("AIOREDUCE_MASTER_PORT"):
        return connect_env(scheme or default_scheme(), timeout=timeout, state=state)
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except KeyError as exc:
        raise ConfigError(f"aioreduce.torch.connect needs {exc.args[0]} (run under torchrun or "
                          "aioreduce-launch)") from None
    wait = timedelta(seconds=timeout)
    store = TCPStore(host, port, world, rank == 0, wait)
    node = _node_from_store(PrefixStore("aioreduce-connect", store), rank, world, wait, scheme,
                            state)
    node.keepalive = store  # rank 0 serves the store; it lives as long as the node
    return node


def _create(opts: Any, _pg_options: Any = None) -> ProcessGroupAioreduce:
    """torch's creator of a group (its extended form: ``opts`` is a
    ``_DistributedBackendOptions``). The group over the whole job (the default group: no
    ``global_ranks_in_group``) carries :func:`configure`'s ``state``; under aioreduce-launch
    it meets at the launcher's rendezvous address, as :func:`aioreduce.connect` does, not
    through torch's store: a replacement of any rank, rank 0 included, finds the running job
    there (a rank 0 that rendezvoused through the store picks a free port and a job id of its
    own, so its replacement would start another job). Other groups meet through the store."""
    whole = not opts.global_ranks_in_group
    env = os.environ
    if whole and env.get("AIOREDUCE_SECRET") and env.get("AIOREDUCE_MASTER_PORT"):
        node = connect_env(default_scheme(), timeout=None, state=_state)
    else:
        node = _node_from_store(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                state=_state if whole else None)
    return ProcessGroupAioreduce(node, owns_node=True)


def group_of(node: SyncNode | ProcessGroupAioreduce | None) -> ProcessGroupAioreduce:
    """The process group a wrapper (DDP, the optimizer) runs over: ``node``'s own, a new one
    over a blocking node, or with ``None`` the job's default group, made by
    ``init_process_group(backend="aioreduce")``."""
    if isinstance(node, ProcessGroupAioreduce):
        return node
    if node is not None:
        return ProcessGroupAioreduce(node)
    pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if not isinstance(pg, ProcessGroupAioreduce):
        raise ConfigError("no node given and no default process group of aioreduce's: pass "
                          "a node, or call init_process_group(backend=\"aioreduce\") first")
    return pg


def _monitored_barrier(group: Any = None, timeout: timedelta | None = None,
                       wait_all_ranks: bool = False) -> Any:
    """``dist.monitored_barrier``, which torch refuses for any backend but Gloo by name: our
    groups get our own (a barrier that names the ranks missing at its timeout)."""
    pg = group
    if pg is None and dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
    if isinstance(pg, ProcessGroupAioreduce):
        return pg.monitored_barrier(timeout, wait_all_ranks)
    return _torch_monitored_barrier(group, timeout, wait_all_ranks)


_torch_monitored_barrier: Callable[..., Any] = dist.monitored_barrier


def register() -> None:
    """Register backend "aioreduce" with ``torch.distributed`` for CPU and CUDA tensors
    (idempotent), and let ``dist.monitored_barrier`` serve its groups."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    if dist.monitored_barrier is not _monitored_barrier:
        dist.monitored_barrier = _monitored_barrier
        dist.distributed_c10d.monitored_barrier = _monitored_barrier
