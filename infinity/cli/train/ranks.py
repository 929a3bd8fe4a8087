"""``infinity train`` over several processes (data parallel, chunks sharded over the ranks).

``--nproc N`` re-runs the same command as N local processes through
``torch.distributed.run`` (standalone rendezvous); ``torchrun ... -m infinity
train`` does the same by hand, on one node or many. Under a launcher
(``WORLD_SIZE`` > 1) every process joins the default group (gloo for CPU
tensors, NCCL for CUDA ones) and :func:`infinity.offload` shards the model over
it. The batch size is per process: rank r of n takes rows r, r+n, ... of a
global batch drawn as one process would draw n times the batch, so n ranks x B
train on exactly the samples of 1 process x nB. Rank 0 alone prints and writes
the plot; checkpoints are written by rank 0 while every rank gathers.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import torch
import torch.distributed as dist

from infinity.cli.main import CommandError
from infinity.cli.train.checkpoints import RunDirectory
from infinity.cli.train.report import HumanReport, JsonReport, RunSummary
from infinity.config import Config
from infinity.data import Batches
from infinity.distributed import Collectives, DistributedError, resolve_world
from infinity.offload import find_engine
from infinity.runtime.swap import swap_directory

DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for a peer before failing
# The launcher starts each process in a session of its own, so Ctrl-C reaches
# only the launcher. It forwards each SIGINT as it comes (one: stop after the step
# with a checkpoint; two: abandon the step), where torch's launcher would send one
# and kill the processes 30 s later. SIGTERM and the rest it forwards itself.
_LAUNCHER_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``processes`` flags of ``infinity train``."""
    group = parser.add_argument_group("processes (data parallel)")
    group.add_argument(
        "--nproc",
        metavar="N",
        type=int,
        default=1,
        help="train on N local processes, each with its share of every chunk and its own "
        "budgets; --batch-size is per process (default: 1; under torchrun: its processes)",
    )
    group.add_argument(
        "--dist-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"how long a process waits for the others in a collective before failing "
        f"(default: {DEFAULT_TIMEOUT:.0f})",
    )


def _launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def wants_launch(args: argparse.Namespace) -> bool:
    """``--nproc N`` (N > 1) given outside a launcher: the processes must be started."""
    if args.nproc < 1:
        raise CommandError(f"--nproc must be >= 1, got {args.nproc}")
    if args.dist_timeout <= 0:
        raise CommandError(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout:g}")
    world = _launched_world()
    if world > 1 and args.nproc not in (1, world):
        raise CommandError(
            f"--nproc {args.nproc} under a launcher that started {world} processes: "
            "drop --nproc (the launcher decides how many)"
        )
    return args.nproc > 1 and world == 1


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--nproc":
            skip = True
        elif not token.startswith("--nproc="):
            out.append(token)
    return out


def launch(args: argparse.Namespace) -> int:
    """Run this command as ``args.nproc`` local processes through ``torch.distributed.run``;
    the exit code of the first process that failed (0 if none did).

    The launcher runs in this process rather than as ``python -m
    torch.distributed.run``, whose exit code is 1 whatever its workers' were.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    argv = _without_nproc(list(args.argv))
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # no oversubscribed cores
    launcher = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            f"--signals-to-handle={_LAUNCHER_SIGNALS}",
            "--module",
            "infinity",
            *argv,
        ]
    )
    # Each process prints its own error; the launcher's log line would repeat it.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    previous = signal.signal(signal.SIGINT, _forward_to_processes)
    try:
        torchrun(launcher)
    except SignalException as exc:  # SIGTERM & co.: torch's launcher stopped the processes
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        name = signal.Signals(-failure.exitcode).name
        print(f"infinity: error: rank {rank} was killed by {name}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _forward_to_processes(signum: int, frame: FrameType | None) -> None:
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


@dataclass
class Ranks:
    """This process among the training processes; one process: rank 0 of 1, no collectives."""

    rank: int = 0
    size: int = 1
    collectives: Collectives | None = None

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0

    def any(self, flag: bool, what: str) -> bool:
        """True on every rank if ``flag`` is on any (e.g. a Ctrl-C one rank saw first)."""
        return flag if self.collectives is None else self.collectives.any(flag, what)

    def mean(self, value: float, what: str) -> float:
        """The mean of ``value`` over the ranks."""
        if self.collectives is None:
            return value
        return self.collectives.sum(value, what) / self.size

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        return [value] if self.collectives is None else self.collectives.gather_object(value, what)

    def batches(
        self,
        data: torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
        mask: torch.Tensor | None = None,
    ) -> Batches:
        """This rank's rows of the global batches (``batch_size`` per rank)."""
        if self.size == 1:
            return Batches(data, seq_len, batch_size, seed, mask)
        rows = _RankRows(data, seq_len, batch_size * self.size, seed, mask)
        rows.rows = slice(self.rank, None, self.size)
        return rows


class _RankRows(Batches):
    """Rows ``rank::size`` of each batch of ``size`` times the per-rank batch size."""

    rows: slice  # this rank's: rank::size

    def get(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().get(step, micro)
        return inputs[self.rows], targets[self.rows]


SINGLE = Ranks()


@contextmanager
def joined(args: argparse.Namespace) -> Iterator[Ranks]:
    """This process's :class:`Ranks`: under a launcher, join the default group for the
    run (left again at the end, also on errors); errors name the rank."""
    if _launched_world() == 1:
        yield SINGLE
        return
    backend = "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.dist_timeout))
    except (RuntimeError, ValueError) as exc:
        raise CommandError(f"cannot join the other processes ({backend}): {exc}") from None
    world = resolve_world()
    ranks = Ranks(world.rank, world.size, Collectives(world))
    try:
        yield ranks
    except DistributedError as exc:
        raise CommandError(str(exc)) from None
    except CommandError as exc:
        raise CommandError(f"rank {ranks.rank} of {ranks.size}: {exc}") from None
    finally:
        dist.destroy_process_group()


class _Silent(HumanReport):
    """The report of ranks other than 0: nothing at all.

    What a report says (progress, a stop, an abandoned step) is agreed by
    every rank, so rank 0 says it; a rank's own failure is its error message.
    """

    def __init__(self) -> None:
        super().__init__(quiet=True)

    def _print(self, text: str = "") -> None:
        pass

    def alert(self, text: str) -> None:
        """Rank 0 alerts for all."""


def report_for(args: argparse.Namespace, ranks: Ranks) -> HumanReport | JsonReport:
    """Rank 0's report is the usual one; the others stay silent."""
    if not ranks.main:
        return _Silent()
    return JsonReport() if args.json else HumanReport(quiet=args.quiet)


def share_run_dir(
    ranks: Ranks, opened: tuple[RunDirectory, str | None] | None
) -> tuple[RunDirectory, str | None]:
    """Rank 0's run directory (it opened and locked it) on every rank."""
    if ranks.size == 1:
        assert opened is not None
        return opened
    mine = None if opened is None else (str(opened[0].path), opened[0].fresh, opened[1])
    path, fresh, forked = ranks.gather(mine, "sharing the run directory")[0]
    if opened is not None:
        return opened
    return RunDirectory(Path(path), -1, [], fresh), forked  # rank 0 holds the lock


def leave_nvme(ranks: Ranks, config: Config) -> None:
    """Once every rank's swap files are gone, remove this rank's (empty) folder under
    ``nvme_path``, and wait for the others so rank 0 may remove ``nvme_path`` itself."""
    if ranks.collectives is None or config.nvme_path is None:
        return
    with contextlib.suppress(OSError):
        os.rmdir(swap_directory(config))
    ranks.collectives.barrier("leaving the NVMe folders")


def bytes_sent(model: torch.nn.Module) -> int:
    """Payload bytes this rank has sent in collectives (0 in one process)."""
    collectives = getattr(find_engine(model), "collectives", None)
    return int(getattr(collectives, "bytes_sent", 0))


def per_rank(ranks: Ranks, summary: RunSummary, stats: dict[str, Any]) -> list[dict[str, float]]:
    """Each rank's peak memory and bytes sent per step, gathered on every rank."""
    steps = max(1, len(summary.losses))
    mine = {
        "device_peak_bytes": stats["device_peak_bytes"],
        "host_peak_bytes": stats["host_peak_bytes"],
        "nvme_bytes": stats["nvme_bytes"],
        "sent_bytes_per_step": summary.step_totals.get("sent_bytes", 0.0) / steps,
    }
    return ranks.gather(mine, "gathering each rank's memory for the summary")


def header_line(ranks: Ranks, record_batch: int) -> list[str]:
    """What the header says about the processes (nothing for one)."""
    if ranks.size == 1:
        return []
    backend = dist.get_backend()
    return [
        f"processes: {ranks.size} ({backend}); each holds 1/{ranks.size} of every chunk within "
        f"its own budgets and trains on {record_batch} sequences of each step's "
        f"{record_batch * ranks.size}"
    ]
