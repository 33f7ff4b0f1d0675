"""The lane links' bookkeeping (``schemes/links/posts.py``) under every interleaving
of a step's events, as a hypothesis state machine: the session posts receives, discards steps
(while a reader is in the middle of a chunk) and loses peers; readers claim posts, write chunks
and complete them, in any order between those. The invariants are the links' guarantees: a
buffer is written only while its post is live (or in the one chunk the session waits for), a
post leaves the book once, a message below the floor is dropped. (The links used to list the
keys to discard, then pop them one by one, waiting for a chunk in between: a post a reader
completed during that wait made the next pop raise ``KeyError``, the crash seen with
``hadamard: false``. The book takes every post out at once, before the caller waits.)"""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aioreduce.schemes.links.posts import Post, PostBook, Wait

SRCS, STEPS, TAGS = (1, 2), (0, 1, 2, 3), (0, 1)
LOOP = asyncio.new_event_loop()  # futures only; nothing runs on it


class Book(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = PostBook()
        self.made: list[Post] = []  # every post ever made
        self.left: dict[int, str] = {}  # id(post) -> how it left the book
        self.writing: Post | None = None  # a reader between begin_write and end_write
        self.waited: list[Post] = []  # posts a discard must wait for

    @rule(src=st.sampled_from(SRCS), step=st.sampled_from(STEPS), tag=st.sampled_from(TAGS))
    def post(self, src: int, step: int, tag: int) -> None:
        key = (src, step, tag)
        if key in self.book.posts or (step, tag) < self.book.floor or \
                any(p.key == key for p in self.made):
            return  # the session posts a key once, for a step not over
        post = Post(key, memoryview(bytearray(4)), LOOP.create_future())
        self.book.post(post)
        self.made.append(post)

    @precondition(lambda self: self.writing is None)
    @rule(src=st.sampled_from(SRCS), step=st.sampled_from(STEPS), tag=st.sampled_from(TAGS))
    def arrive_and_begin(self, src: int, step: int, tag: int) -> None:
        got = self.book.claim(src, step, tag)
        if got is None:
            assert (step, tag) < self.book.floor  # dropped only below the floor
            return
        if isinstance(got, Wait):
            assert (src, step, tag) not in self.book.posts
            return
        assert got.key == (src, step, tag) and not got.withdrawn
        if self.book.begin_write(got):
            got.view[0] = 1  # a chunk lands: the post must be live
            assert id(got) not in self.left
            self.writing = got

    @precondition(lambda self: self.writing is not None)
    @rule(done=st.booleans())
    def end_chunk(self, done: bool) -> None:
        post = self.writing
        assert post is not None
        self.book.end_write(post)
        self.writing = None
        if done and self.book.complete(post):
            self._left(post, "completed")

    @rule(step=st.sampled_from(STEPS), tag=st.sampled_from(TAGS))
    def discard_before(self, step: int, tag: int) -> None:
        before = dict(self.book.posts)
        waiting = self.book.discard_before(step, tag)
        for key, post in before.items():
            if key not in self.book.posts:
                self._left(post, "withdrawn")
                assert post.withdrawn and (key[1], key[2]) < self.book.floor
        assert all(p.writing for p in waiting)
        self.waited = waiting

    @rule(src=st.sampled_from(SRCS))
    def lose(self, src: int) -> None:
        for post in self.book.lose(src):
            assert post.key[0] == src
            self._left(post, "lost")

    def _left(self, post: Post, how: str) -> None:
        assert id(post) not in self.left, (post.key, self.left[id(post)], how)  # once
        self.left[id(post)] = how

    @invariant()
    def consistent(self) -> None:
        for key, post in self.book.posts.items():
            assert post.key == key and not post.withdrawn and id(post) not in self.left
            assert (key[1], key[2]) >= self.book.floor
        # Only the chunk in progress may be writing; a withdrawn post can be writing only as
        # that chunk, which the session's discard waits for.
        for post in self.made:
            assert not post.writing or post is self.writing
        assert all(p is self.writing for p in self.waited if p.writing)


Book.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestPostBook = Book.TestCase
