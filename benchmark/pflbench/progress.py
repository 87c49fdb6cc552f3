"""Progress a person can read: a rich bar on a terminal; in a pipe or a log file (where a bar is
redrawn into one truncated line, e.g. `200/2… eta 0:00:…`), a full line every few seconds and
when a task finishes."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

LINE_EVERY_SECONDS = 15.0


def make_progress(label: str, *columns: Any, enabled: bool = True, file: TextIO | None = None):
    """A rich Progress with `columns` when stdout is a terminal, else a LineProgress. Both take
    add_task(description, total=, completed=, **fields) and update(task, advance=, completed=,
    total=, description=, **fields) and are context managers."""
    out = file or sys.stdout
    if enabled and out.isatty():
        from rich.progress import Progress

        return Progress(*columns, transient=False)
    return LineProgress(label, enabled=enabled, file=out)


def hms(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    fields: dict
    started: float
    start_completed: float
    printed_at: float
    printed_completed: float | None = None


@dataclass
class LineProgress:
    """One full line per task every `every` seconds of updates, and at its end."""

    label: str
    enabled: bool = True
    file: TextIO | None = None
    every: float = LINE_EVERY_SECONDS
    tasks: list[_Task] = field(default_factory=list)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        for task in self.tasks:  # the state reached, unless that line was just printed
            if task.printed_completed != task.completed:
                self._print(task, time.monotonic())

    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 **fields: Any) -> int:  # fmt: skip
        now = time.monotonic()
        self.tasks.append(_Task(description, total, completed, fields, now, completed, now))
        return len(self.tasks) - 1

    def update(self, task_id: int, *, advance: float | None = None,
               completed: float | None = None, total: float | None = None,
               description: str | None = None, **fields: Any) -> None:  # fmt: skip
        task = self.tasks[task_id]
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        if total is not None:
            task.total = total
        if description is not None:
            task.description = description
        task.fields.update(fields)
        now = time.monotonic()
        finished = task.total is not None and task.completed >= task.total
        reached = finished and task.printed_completed != task.completed  # print the end once
        if reached or now - task.printed_at >= self.every:
            self._print(task, now)

    def line(self, task: _Task, now: float) -> str:
        elapsed = now - task.started
        counts = f"{task.completed:g}"
        if task.total is not None:
            counts += f"/{task.total:g} ({100 * task.completed / max(task.total, 1):.0f}%)"
        times = f"elapsed {hms(elapsed)}"
        done = task.completed - task.start_completed
        if task.total is not None and done > 0 and task.completed < task.total:
            times += f" eta {hms((task.total - task.completed) * elapsed / done)}"
        parts = [self.label, counts, times, task.description, *map(str, task.fields.values())]
        return "  ".join(p for p in parts if p)

    def _print(self, task: _Task, now: float) -> None:
        task.printed_at, task.printed_completed = now, task.completed
        if self.enabled:
            print(self.line(task, now), file=self.file or sys.stdout, flush=True)
