"""Which task the host optimizer's worker takes next: the one whose result is needed first.

Gradients land in backward order (the last block first), but the next forward needs the
updates in the opposite order (the first block first). Taking them as they landed leaves the
first blocks' updates for last, so a host that has fallen behind holds up the next forward from
its first block. With ``AdamW.host_order="deadline"`` (the default) the worker instead takes, among the
gradients that have landed, the one whose result the device will need first (earliest deadline
first):

1. an earlier micro-batch's gradient (``final=False``), in landing order: the next micro-batch's
   backward reuses its landing zone, last block first;
2. then the update whose unit the next forward reaches first: ``rest`` (reloaded before
   anything runs), then blocks by index. An update under way yields, between pieces, to one
   that is due sooner (:class:`TaskBoard` names it, the worker resumes the other later).

With every gradient landing in backward order this makes the host work, in the steady state,
on the block the backward has just finished, and what is left when backward ends is the blocks
the forward needs last: their updates overlap the next forward. Any order gives the same
numbers (each unit's update reads only its own state). The cost model prices either order
(``cost.py``; in this one the host term is preemptive earliest-deadline-first's).

A task that is not a gradient (``finish``, ``lr``, ``flush``, a question) is a barrier: nothing
behind it moves ahead of it, and it runs once every update started before it is complete.
Without a deadline (``host_order="landing"``, and always under data parallelism,
where every rank must exchange shards in the same order) tasks run in arrival order, each
update whole.
"""
from __future__ import annotations

import queue
from typing import Callable, Collection

__all__ = ["TaskBoard", "deadline_of"]

#: A worker task: (kind, argument, callback), see ``HostOptimizer._run``.
Task = tuple


def deadline_of(is_block: list[bool]) -> Callable[[int], int]:
    """The order in which the next forward needs units: ``rest`` first (-1), then blocks by index."""
    return lambda index: index if is_block[index] else -1


class TaskBoard:
    """The worker's tasks in arrival order, and which to work on next.

    Args:
        tasks: the queue the training thread puts tasks on.
        deadline: a unit index's rank in the next forward's order (:func:`deadline_of`); None:
            arrival order, and no update yields to another.
    """

    def __init__(self, tasks: queue.Queue, deadline: Callable[[int], int] | None) -> None:
        self._tasks = tasks
        self.deadline = deadline
        #: tasks taken off the queue and not yet worked on, in arrival order
        self.backlog: list[Task] = []
        # Backlog tasks seen landed, by id: a landing is for good, so its event is not asked
        # again. Each ask is a call into the device runtime (an event query), and every pick
        # used to ask the whole landed backlog: some 50 tasks, several picks a unit (one a
        # piece), in a host-bound 128-layer step.
        self._landed: set[int] = set()

    def fill(self, block: bool) -> None:
        """Move every queued task to the backlog; ``block``: wait for one if the backlog is empty."""
        if block and not self.backlog:
            self.backlog.append(self._tasks.get())
        while True:
            try:
                self.backlog.append(self._tasks.get_nowait())
            except queue.Empty:
                return

    def next(self, paused: Collection[int]) -> Task | int | None:
        """What to work on now: a backlog task (still in the backlog: :meth:`remove` it once
        taken), the index of a paused update to resume (one of ``paused``), or None when nothing
        is ready (no task has landed and no update waits to be resumed)."""
        resume = min(paused, key=self.deadline) if paused else None
        if not self.backlog:
            return resume
        head = self.backlog[0]
        if head[0] != "grad" or self.deadline is None:
            return head if resume is None else resume  # a barrier waits for the updates under way
        seen: set[int] = set()
        best: Task | None = None
        for task in self.backlog:
            if task[0] != "grad":
                break
            index, final = task[1], task[2][1]
            if not self.landed(task):
                break  # the ones behind it land after it (one device stream)
            if index in seen:
                continue  # the unit's earlier task goes first
            seen.add(index)
            if not final:
                return task
            if best is None or self.deadline(index) < self.deadline(best[1]):
                best = task
        if best is None or (resume is not None and self.deadline(resume) < self.deadline(best[1])):
            return resume
        return best

    def landed(self, task: Task) -> bool:
        """Whether backlog task ``task`` can be worked on without waiting: a gradient whose
        copy home is done (asked of its event until it is), or any other task."""
        if task[0] != "grad" or id(task) in self._landed:
            return True
        check = task[2][2]
        if check is not None and not check():
            return False
        self._landed.add(id(task))
        return True

    def remove(self, task: Task) -> None:
        """Take ``task`` off the backlog (it is being worked on)."""
        for k, other in enumerate(self.backlog):
            if other is task:
                del self.backlog[k]
                self._landed.discard(id(task))
                return
        raise ValueError("the task is not in the backlog")
