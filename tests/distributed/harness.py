"""Run a function on N local processes joined in a gloo process group.

``run_ranks(fn, *args)`` starts ``nprocs`` fresh processes (``spawn``), each
joins a gloo group through a TCP store the caller hosts on 127.0.0.1 (a free
port the OS picks, so concurrent runs never collide), calls ``fn(rank, *args)``
and sends back its result. ``fn`` must be a module-level function; its module
is re-imported in each process by name, or from its file when the name is not
importable (pytest's importlib mode gives test modules names that are not).

A rank that raises fails the caller with that rank's traceback; a rank that
exits without a result fails naming its exit code; ranks still running at
``timeout`` are killed and named. No process outlives the call.
``spawn_ranks`` returns every rank's :class:`RankOutcome` instead of raising,
for tests in which a rank is meant to fail (faults).
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

# NOTE: after the first rank fails, the others get this long to fail too (a peer's
# collective sees the closed connection in well under a second with gloo) before
# they are killed, so a test sees every rank's own error, not just a kill.
GRACE_AFTER_FAILURE = 15.0


class RanksFailed(AssertionError):
    """A rank raised, exited without a result, or hung past the timeout."""


@dataclass
class RankOutcome:
    """How one rank ended: a ``result``, an ``error`` (traceback text) or a bare exit."""

    rank: int
    pid: int | None = None
    result: Any = None
    error: str | None = None
    exitcode: int | None = None
    finished: bool = False  # fn returned and its result arrived
    killed: str | None = None  # why the rank was killed while still running

    def describe(self) -> str:
        """One rank's failure for a test failure message."""
        if self.error is not None:
            return f"rank {self.rank} raised:\n{self.error}"
        if self.killed is not None:
            return f"rank {self.rank} was still running: killed {self.killed}"
        return f"rank {self.rank} exited with code {self.exitcode} without a result"


def _load_function(module: str, path: str | None, qualname: str) -> Callable[..., Any]:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if path is None:
            raise
        spec = importlib.util.spec_from_file_location(module, path)
        assert spec is not None and spec.loader is not None, path
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    target: Any = mod
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _rank_main(
    rank: int,
    nprocs: int,
    port: int,
    group_timeout: float,
    threads: int,
    target: tuple[str, str | None, str],
    payload: bytes,
    conn: Connection,
) -> None:
    """One rank: join the group, run the function, send ("ok", result) or ("error", tb)."""
    try:
        torch.set_num_threads(threads)
        fn = _load_function(*target)
        args = pickle.loads(payload)  # after the module is loaded: args may use its classes
        store = dist.TCPStore(
            "127.0.0.1", port, nprocs, is_master=False, timeout=timedelta(seconds=group_timeout)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=nprocs,
            timeout=timedelta(seconds=group_timeout),
        )
        try:
            result = fn(rank, *args)
        finally:
            # NOTE: a clean destroy only; a peer that died must not make this rank hang here.
            dist.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _target_of(fn: Callable[..., Any]) -> tuple[str, str | None, str]:
    if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
        raise TypeError(f"run_ranks needs a module-level function, got {fn.__qualname__}")
    module = sys.modules.get(fn.__module__)
    return fn.__module__, getattr(module, "__file__", None), fn.__qualname__


def spawn_ranks(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 120.0,
    group_timeout: float = 60.0,
) -> list[RankOutcome]:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks; every rank's outcome, in rank order.

    Raises:
        RanksFailed: ranks still running at ``timeout`` (killed, then named).
    """
    target = _target_of(fn)
    payload = pickle.dumps(args)
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    # The caller hosts the store: the OS picks a free port and keeps it bound.
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    outcomes = [RankOutcome(rank) for rank in range(nprocs)]
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(nprocs):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, nprocs, store.port, group_timeout, threads, target, payload, child),
                name=f"rank-{rank}",
            )
            proc.start()
            outcomes[rank].pid = proc.pid
            child.close()
            procs.append(proc)
            conns[parent] = rank
        first_failure = _collect(procs, conns, outcomes, time.monotonic() + timeout)
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                outcomes[rank].killed = "(the run was interrupted)"
            proc.join()
            outcomes[rank].exitcode = proc.exitcode
        for conn in conns:
            conn.close()
        del store
    running = [o.rank for o in outcomes if o.killed is not None]
    if first_failure is not None:
        for rank in running:
            why = f"{GRACE_AFTER_FAILURE:.0f} s after rank {first_failure} failed"
            outcomes[rank].killed = why
    elif running:
        raise RanksFailed(
            f"ranks {running} of {nprocs} were still running after {timeout:.0f} s and were "
            "killed"
            + "".join(f"\n{o.describe()}" for o in outcomes if not o.finished and o.killed is None)
        )
    return outcomes


def _collect(
    procs: list[Any], conns: dict[Connection, int], outcomes: list[RankOutcome], deadline: float
) -> int | None:
    """Read each rank's message until all ended, the deadline, or the grace after a failure.

    Returns the first rank that failed, if any.
    """
    first_failure: int | None = None
    pending = dict(conns)
    alive = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while pending or alive:
        now = time.monotonic()
        if now >= deadline:
            return first_failure
        ready = wait([*pending, *alive], timeout=deadline - now)
        for item in ready:
            if item in alive:
                rank = alive.pop(item)
                procs[rank].join()
                outcomes[rank].exitcode = procs[rank].exitcode
                failed = outcomes[rank].exitcode != 0
            else:
                assert isinstance(item, Connection)
                rank = pending.pop(item)
                try:
                    kind, body = item.recv()
                except EOFError:  # the rank died before sending anything
                    continue
                if kind == "ok":
                    outcomes[rank].result = pickle.loads(body)
                    outcomes[rank].finished = True
                    failed = False
                else:
                    outcomes[rank].error = body
                    failed = True
            if failed and first_failure is None:
                first_failure = rank
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
    return first_failure


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    timeout: float = 120.0,
    group_timeout: float = 60.0,
) -> list[Any]:
    """``fn(rank, *args)`` on ``nprocs`` gloo ranks; their results in rank order.

    Raises:
        RanksFailed: a rank raised (its traceback is in the message), exited
            without a result, or was still running at ``timeout``.
    """
    outcomes = spawn_ranks(fn, *args, nprocs=nprocs, timeout=timeout, group_timeout=group_timeout)
    failed = [o for o in outcomes if not o.finished]
    if failed:
        raise RanksFailed(
            f"{len(failed)} of {nprocs} ranks failed:\n" + "\n".join(o.describe() for o in failed)
        )
    return [o.result for o in outcomes]


def state_rel_error(ours: dict[str, Any], ref: dict[str, Any]) -> float:
    """Relative L2 error of a state dict ``ours`` against the reference ``ref``, over
    all of ``ref``'s tensors together (in float64)."""
    num = sum(float((ours[k].double() - v.double()).pow(2).sum()) for k, v in ref.items())
    den = sum(float(v.double().pow(2).sum()) for v in ref.values())
    return (num / den) ** 0.5
