"""What a step's message says about how it was made, typed, and how it travels in meta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ...errors import AioreduceError, VectorMismatch
from ..base import StragglerError

MAX_TEXT = 1000  # characters of a mismatch message kept from a peer


def _ints(value: object) -> tuple[int, ...]:
    # (type() is, not isinstance: cheaper, and a peer's bools are not ranks)
    if type(value) is not list and type(value) is not tuple:
        return ()
    if not value:  # (a report's "late" nearly always: no comprehension, no sort)
        return ()
    return tuple(sorted([v for v in value if type(v) is int]))


class Report(NamedTuple):
    """Ranks a (partial) sum used and skipped, and whether it is exact.

    ``error_bound`` is the approximate decode's error factor (0 when exact). A rank's report
    combines its own and those of the children it decoded from. A named tuple, not a frozen
    dataclass: every data frame of a tree step reads one, and a frozen dataclass's
    ``__init__`` costs four times a named tuple's.
    """

    used: tuple[int, ...] = ()
    late: tuple[int, ...] = ()
    exact: bool = True
    error_bound: float = 0.0

    def to_meta(self) -> dict[str, Any]:
        return {"used": list(self.used), "late": list(self.late), "exact": self.exact,
                "err": self.error_bound}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Report:
        """Read a peer's report, tolerating missing or mistyped fields."""
        err = meta.get("err", 0.0)
        return cls(_ints(meta.get("used")), _ints(meta.get("late")),
                   bool(meta.get("exact", True)),
                   float(err) if isinstance(err, int | float) else 0.0)

    @classmethod
    def combine(cls, rank: int, kids: list[int], reports: dict[int, Report],
                used_kids: set[int], exact: bool, err: float) -> Report:
        """This rank's report from its children's (``reports`` by child index)."""
        used: list[int] = [rank]
        late: list[int] = []
        for i, child in enumerate(kids):
            if i in used_kids:
                rep = reports.get(i, Report((child,)))
                used += rep.used
                late += rep.late
                exact = exact and rep.exact
                err = max(err, rep.error_bound)
            else:
                late.append(child)
        return cls(tuple(sorted(used)), tuple(sorted(late)), exact, err)


@dataclass(frozen=True)
class Verdict:
    """Why a step has no result for the asking rank: ranks missing (every rank raises
    StragglerError; ``lost``: those of them whose process died, as a rank that saw its
    connection break says), ranks whose vectors differ (``mismatch``, the message every rank
    raises as VectorMismatch), or the step is older than what is kept (FellBehind at
    ``behind``)."""

    missing: tuple[int, ...] = ()
    behind: int | None = None
    mismatch: str = ""
    lost: tuple[int, ...] = ()

    def to_meta(self) -> dict[str, Any]:
        if self.behind is not None:
            return {"behind": self.behind}
        if self.mismatch:
            return {"missing": list(self.missing), "mismatch": self.mismatch[:MAX_TEXT]}
        if self.lost:
            return {"missing": list(self.missing), "lost": list(self.lost)}
        return {"missing": list(self.missing)}

    def error(self, step: int) -> AioreduceError:
        """The exception every rank raises for this verdict."""
        if self.mismatch:
            return VectorMismatch(self.mismatch, list(self.missing))
        if self.lost:
            return StragglerError(step, list(self.missing), f"lost: {list(self.lost)}",
                                  lost=list(self.lost))
        return StragglerError(step, list(self.missing))

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Verdict:
        behind = meta.get("behind")
        if isinstance(behind, int):
            return cls(behind=behind)
        text = meta.get("mismatch")
        missing = _ints(meta.get("missing"))
        return cls(missing, mismatch=text[:MAX_TEXT] if isinstance(text, str) else "",
                   lost=tuple(r for r in _ints(meta.get("lost")) if r in missing))
