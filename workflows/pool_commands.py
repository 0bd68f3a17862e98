"""A pool's commands in flight, each in an asyncio task of its own.

A step issues its commands (drains then terminates, child starts, rotate
signals, endpoint checks, the reconcile) without waiting for any: each runs
in a task of its own, and the pool steps again when one ends. The pool
hands over to its next run, and ends, only when none is left, and waits for
the members it started to close, as their closing is an event of its run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Coroutine
from typing import Any

from temporalio import workflow


class Commands:
    """The tasks under way, and the member starts among them."""

    def __init__(self, ended: Callable[[], None]) -> None:
        # `ended`: a command ended, so the pool steps again.
        self._ended = ended
        self._tasks: set[asyncio.Task[None]] = set()
        # Members whose start command has not been answered yet.
        self.starting: set[str] = set()
        # Members this run started: their closing is an event of this run.
        self.children: dict[str, workflow.ChildWorkflowHandle[Any, Any]] = {}

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in a task of its own; the pool steps again when it ends."""
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            self._ended()

        task.add_done_callback(done)

    @property
    def idle(self) -> bool:
        """No command is under way."""
        return not self._tasks

    @property
    def under_way(self) -> int:
        """How many commands are under way."""
        return len(self._tasks)

    def children_closed(self, members: Container[str]) -> bool:
        """Every member this run started and no longer has among `members` has closed."""
        return all(h.done() for m, h in self.children.items() if m not in members)
