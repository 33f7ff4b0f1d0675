"""Which posted receive an incoming message fills, and when its buffer may still be written:
the bookkeeping of :class:`~.lanes.LaneLinks`, without threads or sockets.

Two sides touch it: the session (post a receive, declare steps over, lose a peer) and one
reader thread per peer (claim the post a message fills, write its payload chunk by chunk,
complete it). :class:`~.lanes.LaneLinks` calls every method under one lock and waits on its
condition where a method says so; here each call is one atomic event, so a test can run any
interleaving of them (``tests/unit/test_lane_posts.py`` does, with hypothesis).

The guarantees: a buffer is written only while its post is in the book and not withdrawn (a
chunk that began before the withdrawal may finish: the session waits for it, see
:meth:`PostBook.discard_before`); a message below the floor is dropped; a post leaves the
book exactly once, whoever takes it out first (the reader completing it, the session
discarding its step, the peer's lane ending).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ...wire import Header

Key = tuple[int, int, int]  # (src, step, tag)


@dataclass(eq=False)
class Post:
    """A posted receive of ``key`` into ``view`` (``future`` None: no receive, a buffer of the
    links' own for a message that came early; see ``LaneLinks``)."""

    key: Key
    view: memoryview
    future: asyncio.Future[Header] | None
    writing: bool = False  # a chunk is being copied into ``view`` now
    withdrawn: bool = False  # out of the book before it was filled: never written again
    unit: int = 1  # > 1: written in whole elements of this many bytes only
    landed: int = 0  # bytes written so far (asked for after a withdrawal where ``unit`` > 1)


class Wait:
    """:meth:`PostBook.claim`'s answer when the message is ahead of every post: wait."""


WAIT = Wait()


class PostBook:
    """The posts of one rank's incoming slices (see the module docstring). Not thread-safe:
    the caller holds its lock around every call."""

    def __init__(self) -> None:
        self.posts: dict[Key, Post] = {}
        self.floor: tuple[int, int] = (-1, 0)  # (step, tag) below this is over
        # Withdrawn posts written in whole elements: what landed in them is asked for after
        # (see landed); kept until their step is forgotten.
        self.cut: dict[Key, Post] = {}

    def post(self, post: Post) -> None:
        """Add ``post`` (a second post of one key replaces nothing: it is a caller's bug)."""
        if post.key in self.posts:
            raise RuntimeError(f"a receive of {post.key} is already posted")
        self.posts[post.key] = post

    def claim(self, src: int, step: int, tag: int) -> Post | Wait | None:
        """The post a message (src, step, tag) fills; ``None``: it is below the floor (drop
        it); ``WAIT``: not posted yet (the reader waits, its lane fills: backpressure)."""
        if (step, tag) < self.floor:
            return None
        return self.posts.get((src, step, tag), WAIT)

    def begin_write(self, post: Post) -> bool:
        """Before copying a chunk into ``post``'s buffer: False if it was withdrawn (the
        reader drops the rest of the message)."""
        if post.withdrawn:
            return False
        post.writing = True
        return True

    def end_write(self, post: Post) -> None:
        """After that chunk's copy (the session may be waiting for it)."""
        post.writing = False

    def complete(self, post: Post) -> bool:
        """The whole payload is in; True if ``post`` was still in the book (it is taken out:
        the reader completes its future), False if it was withdrawn meanwhile."""
        if self.posts.get(post.key) is not post:
            return False
        del self.posts[post.key]
        return True

    def discard_before(self, step: int, tag: int = 0) -> list[Post]:
        """Steps below (step, tag) are over: withdraw their posts. Returns those being
        written at this moment: the caller waits until none of them is ``writing`` (one
        chunk's copy at most) before it reuses their buffers."""
        self.floor = max(self.floor, (step, tag))
        over = [p for k, p in self.posts.items() if (k[1], k[2]) < self.floor]
        for post in over:
            del self.posts[post.key]
            post.withdrawn = True
            if post.unit > 1:
                self.cut[post.key] = post
        return [p for p in over if p.writing]

    def landed(self, key: Key) -> int:
        """Bytes (whole elements) that landed in the withdrawn post of ``key`` before it was
        withdrawn; 0 if it was not one written in whole elements, or is forgotten. Final
        once no chunk is being written into it (see :meth:`discard_before`)."""
        post = self.cut.get(key)
        return post.landed if post is not None else 0

    def forget(self, step: int) -> None:
        """Steps up to ``step`` are over for good: their withdrawn posts are let go."""
        for key in [k for k in self.cut if k[1] <= step]:
            del self.cut[key]

    def lose(self, src: int) -> list[Post]:
        """``src``'s lane ended: take its posts out (the caller fails them)."""
        gone = [p for k, p in self.posts.items() if k[0] == src]
        for post in gone:
            del self.posts[post.key]
            if post.unit > 1:  # (its lane broke while it came: see landed)
                self.cut[post.key] = post
        return gone
