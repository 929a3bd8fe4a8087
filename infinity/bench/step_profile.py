"""Where a training step's time goes: per-thread CPU time and time inside the engine.

Two instruments, both cheap enough to leave on while timing (a few hundred
``perf_counter`` pairs per step, one read of ``/proc/self/task`` per block):

- :func:`thread_cpu` reads every thread's user + system CPU seconds from
  ``/proc/self/task/*/stat``, grouped by what the thread is (the main Python
  thread, the engine's named native threads, the rest: torch's intra-op pool);
- :class:`EngineProfile` wraps the engine's hook entry points, the optimizer
  kernel and the blocking waits *at class level* (before ``offload``) and
  accumulates **exclusive** wall time per category: a wait inside a hook counts
  as waiting, not as hook time, and an optimizer update run from a hook counts
  as the kernel plus its own Python. "hooks" is then the engine's own Python
  work on the compute thread.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Engine entry points called by hooks (names looked up at patch time: a method
# that does not exist in this version of the engine is simply not timed).
HOOK_METHODS = (
    "begin_forward",
    "begin_module",
    "end_module",
    "pack",
    "unpack",
    "optimizer_step",
)
SINK_METHODS = ("before_grad", "on_grad")  # the gradient hooks, on the engine's sink


def _thread_group(tid: int, pid: int, name: str) -> str:
    if tid == pid:
        return "main"
    if name.startswith("inf-"):
        return name
    return "other (torch intra-op)"


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process's threads, by group.

    A thread that exited between two readings drops out of the second;
    the engine's and torch's threads live as long as the process, so deltas
    between readings are exact up to the clock tick (10 ms).
    """
    pid = os.getpid()
    out: dict[str, float] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread exited meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[11], fields[12] are utime and stime (fields 14 and 15 of stat(5))
        seconds = (int(fields[11]) + int(fields[12])) / _TICK
        group = _thread_group(int(entry), pid, name)
        out[group] = out.get(group, 0.0) + seconds
    return out


def batch_native_threads() -> int:
    """Put the engine's native threads (named ``inf-*``) under ``SCHED_BATCH``; how many.

    A thread that sleeps a lot (the copy and I/O workers) has little CFS
    runtime, so waking it preempts the compute thread that woke it (while that
    thread holds the GIL, mid-hook). ``SCHED_BATCH`` turns off that wake-up
    preemption for the woken thread; it still runs on an idle core at once,
    and gets its fair share at the next tick otherwise.
    """
    count = 0
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as f:
                name = f.read().strip()
            if name.startswith("inf-"):
                os.sched_setscheduler(int(entry), os.SCHED_BATCH, os.sched_param(0))
                count += 1
        except OSError:
            continue  # the thread exited meanwhile
    return count


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-group CPU seconds between two :func:`thread_cpu` readings."""
    return {k: after[k] - before.get(k, 0.0) for k in after}


class EngineProfile:
    """Exclusive wall time per category on the calling (compute) thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [category, start, time in nested frames]
        self._undo: list[Callable[[], None]] = []

    def _enter(self, category: str) -> None:
        self._stack.append([category, time.perf_counter(), 0.0])

    def _exit(self) -> None:
        category, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[category] = self.seconds.get(category, 0.0) + elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    def _wrap(self, owner: type, name: str, category: str) -> None:
        original = owner.__dict__.get(name)
        if original is None:
            for base in owner.__mro__[1:]:
                original = base.__dict__.get(name)
                if original is not None:
                    break
        if original is None or not callable(original):
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._enter(category)
            try:
                return original(*args, **kwargs)
            finally:
                self._exit()

        had = name in owner.__dict__
        previous = owner.__dict__.get(name)
        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, previous) if had else delattr(owner, name))

    def install(self) -> None:
        """Patch the engine's classes (call before ``infinity.offload``)."""
        from infinity.chunks.pools import Traffic
        from infinity.optim.cpu_adam import ADAM
        from infinity.runtime.engine import OffloadEngine
        from infinity.runtime.gradients import GradientSink

        for name in HOOK_METHODS:
            category = "step (engine)" if name == "optimizer_step" else "hooks"
            self._wrap(OffloadEngine, name, category)
        for name in SINK_METHODS:
            self._wrap(GradientSink, name, "hooks")
        self._wrap(type(ADAM), "step", "adam kernel")
        original = Traffic.waiting
        profile = self

        @contextmanager
        def waiting(traffic: Traffic, tier: str) -> Iterator[None]:
            profile._enter(f"wait {tier}")
            try:
                with original(traffic, tier):
                    yield
            finally:
                profile._exit()

        setattr(Traffic, "waiting", waiting)  # noqa: B010 (a patch, undone below)
        self._undo.append(lambda: setattr(Traffic, "waiting", original))

    def uninstall(self) -> None:
        """Undo :meth:`install`."""
        while self._undo:
            self._undo.pop()()

    def take(self) -> dict[str, float]:
        """Seconds per category since the last call (and reset)."""
        out, self.seconds = self.seconds, {}
        return out
