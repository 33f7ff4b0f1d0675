"""One rank's place in a reduction tree, and the frame tags of a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...codes import GradientCode
from ...wire import tags

# Frame tags within one step. Upward chunks use 0..DOWN-1, the result's chunks DOWN + c.
DOWN = tags.RESULT
VERDICT_TAG = tags.VERDICT  # no payload; meta says why there is no result (see Verdict)
REQUEST_TAG = tags.REQUEST  # no payload; "send me the outcomes from this frame's step on"


@dataclass(frozen=True)
class Family:
    """One rank's parent, children and their code.

    The grandparent serves us when our parent is lost or silent; the grandchildren are the
    ranks we serve when one of our children is lost or silent.
    """

    parent: int | None
    children: list[int]
    code: GradientCode | None  # None: every child is needed and contributions are summed
    parent_m: int = 1  # the parent's message reduction: we send ceil(length / m) entries
    grandparent: int | None = None
    grandchildren: dict[int, list[int]] = field(default_factory=dict)  # child -> its children
    depth: int = 0  # hops from this rank up to the root

    def served(self) -> set[int]:
        """Ranks that may ask this rank for results: children and grandchildren."""
        return set(self.children).union(*self.grandchildren.values())
