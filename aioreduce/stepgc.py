"""Python's garbage collection at step boundaries, at the same steps on every rank.

Why. CPython starts a cyclic collection whenever allocations pass a threshold: on each rank
at its own moment, usually in the middle of a step. A young collection takes a fraction of a
millisecond to a few; a full one, with torch imported (170,000 objects), 30-100 ms. To every
other rank that rank is then a straggler: Ring and Gloo wait for it, a bounded-time scheme
(``Transpose``) cuts it. Measured (``aioreduce-bench allreduce --scheme transpose,ring
--vs-gloo``, 4 ranks, 1 MiB, the tail model of docs/transpose.md): each rank ran 342 young
and 31 middle collections in 600 steps, up to 6 ms each; the transpose's P99/P50 was 1.30-1.35
with 1.02-1.07 % of contributions lost, against 1.20 and 0.93 % with the collector off.
Megatron-LM's ``--manual-gc`` does the same for the same reason.

What. :class:`StepGC` turns the automatic collector off when the node starts. After the first
step it collects once and freezes what survives (imports, torch, the model, the optimizer:
``gc.freeze``, never scanned again); then it runs a full collection after every ``every``-th
step, on every rank after the same step, so the pause is taken by all ranks at once and is
short (only what the steps since made). Closing the node turns the collector back on (if it
was on) and unfreezes. Cyclic garbage made between two collections waits for the next one
(``every`` bounds how long); an object alive after the first step that later becomes cyclic
garbage is not collected while the node runs (the price of never scanning the frozen
objects; a trainer's long-lived objects live as long as it does). Freezing at the start
instead missed what was imported later (the bench imports torch after the node starts), and
each full collection then scanned torch's 170,000 objects: worse than no StepGC at all.
The collector is the process's: give ``gc_every`` to one node per process.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field


@dataclass
class StepGC:
    """Collect after every ``every``-th step (``every`` >= 1); see the module docstring."""

    every: int
    collections: int = 0  # full collections run so far
    _epoch: int = field(default=0, init=False)  # steps // every at the last collection
    _frozen: bool = field(default=False, init=False)
    _was_enabled: bool | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"gc_every must be >= 1 (or 0 to leave the collector alone), "
                             f"not {self.every}")

    @property
    def active(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._was_enabled is not None

    def start(self) -> None:
        """Turn the automatic collector off (until :meth:`stop`)."""
        if self.active:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()

    def after(self, step: int) -> None:
        """Step ``step`` has ended on this rank: collect if it closes a period of ``every``
        steps (after a jump ahead, at the first step past a boundary)."""
        if not self.active:
            return
        epoch = (step + 1) // self.every
        if self._frozen and epoch <= self._epoch:
            return
        self._epoch = epoch
        gc.collect()
        if not self._frozen:  # what survives the first step lives as long as the trainer
            gc.freeze()
            self._frozen = True
        self.collections += 1

    def stop(self) -> None:
        """Undo :meth:`start`: unfreeze, and turn the collector on if it was."""
        if not self.active:
            return
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
