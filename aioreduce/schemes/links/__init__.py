"""How a scheme's messages travel between two ranks, behind one narrow interface (:class:`Links`):
post a receive of (source, step, tag), send in the background, raise a floor under which
messages are dropped on arrival.

:class:`CommLinks` goes through the scheme's comm (frames on the event loop; the in-memory
network of the unit tests). :class:`LaneLinks` goes over the comm's bulk links, blocking lanes
with a reader thread per peer, off the event loop (real meshes). The transpose moves its slices
this way, and the trees and stars their chunks (``StepOptions.lanes``). :class:`SplitLinks`
keeps a peer whose connection broke on the comm (its replacement has no lanes).
"""

from .comm import CommLinks, Links
from .lanes import LaneLinks, unopened
from .posts import Post, PostBook, Wait
from .split import SplitLinks

__all__ = ["CommLinks", "LaneLinks", "Links", "Post", "PostBook", "SplitLinks", "Wait",
           "unopened"]
