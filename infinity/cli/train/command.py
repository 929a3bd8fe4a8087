"""``infinity train``: train a GPT-style byte-level model beyond the memory budgets.

The text is the Python standard library's own source (present on every
machine, offline). The model's parameters, gradients and optimizer states
live in chunks over the device, host and NVMe tiers; by default the budgets
are derived from the model so its states exceed both the device and the host
budget. Shows a progress bar with the bytes each tier moves, and at the end a
summary and memory tables and a memory-timeline PNG of one step. Ctrl-C stops after
the current step with a checkpoint (exit code 130); ``--resume`` continues the same
loss curve. ``--model DIR --data PATH`` fine-tunes a local ``transformers`` model on
the user's text instead (``pretrained.py``), saved in the ``transformers`` layout."""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import infinity
from infinity.cli.main import CommandError
from infinity.cli.train import checkpoints as ckpt
from infinity.cli.train import ranks as train_ranks
from infinity.cli.train.args import DEFAULT_CHECKPOINT_DIR
from infinity.cli.train.loop import Session, StopSignals
from infinity.cli.train.optimizers import CHOICES, tensor_state_bytes
from infinity.cli.train.pretrained import (
    PretrainedModel,
    describe,
    load_byte_corpus,
    save_model,
)
from infinity.cli.train.pretrained import load_corpus as load_pretrained_corpus
from infinity.cli.train.report import HumanReport, JsonReport, RunSummary
from infinity.cli.train.settings import (
    RunSettings,
    as_flags,
    build_config,
    grow_derived,
    resolve_settings,
)
from infinity.data import Corpus, CorpusError, load_corpus
from infinity.devices.choice import choose_dtype
from infinity.offload import engine_of
from infinity.utils.process_memory import reset_device_peak, reset_resident_peak
from infinity.utils.sizes import format_size

DEMO_BUDGET_ATTEMPTS = 6
_Budgets = tuple[infinity.Config, tuple[str, ...]]  # the config, and which budgets are derived


def _none(text: str | None) -> str | None:
    return None if text is None or text.lower() == "none" else text


def _resume_point(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The checkpoint to resume from (if any) and the directory for new checkpoints."""
    given_dir = args.checkpoint_dir is not None
    text = _none(args.checkpoint_dir) if given_dir else DEFAULT_CHECKPOINT_DIR
    directory = Path(text) if text else None
    if args.resume is None:
        return None, directory
    if args.resume == "latest":
        if directory is None:
            raise CommandError("--resume needs a --checkpoint-dir to look in (it is 'none')")
        found = ckpt.latest_checkpoint(directory)
        if found is None:
            raise CommandError(
                f"--resume: no complete checkpoint in '{directory}'; start without --resume, "
                "or point --checkpoint-dir at the run's directory"
            )
        return found, directory
    given = Path(args.resume)
    found = given if (given / ckpt.TRAINER_FILE).is_file() else ckpt.latest_checkpoint(given)
    if found is None:
        raise CommandError(
            f"--resume: '{given}' is neither a checkpoint nor a directory holding one"
        )
    # New checkpoints go next to the resumed run unless --checkpoint-dir says otherwise.
    in_run = found.parent.name.startswith(ckpt.RUN_PREFIX)
    return found, directory if given_dir else (found.parent.parent if in_run else found.parent)


def _open_run_dir(
    directory: Path, resume_from: Path | None, resumed: ckpt.TrainerState | None
) -> tuple[ckpt.RunDirectory, str | None]:
    """Check ``--checkpoint-dir`` and take this run's directory in it (at start-up, before
    training); returns it and, when a resumed run cannot be continued in place, why."""
    created = ckpt.check_directory(directory)
    why = None
    if resume_from is not None and resumed is not None:
        run_path = resume_from.parent
        newest = ckpt.complete_checkpoints(run_path)
        if run_path.name != f"{ckpt.RUN_PREFIX}{resumed.run_id}":
            why = f"{resume_from} is not in its run's directory"
        elif run_path.parent.resolve() != directory.resolve():
            why = f"checkpoints go to '{directory}'"
        elif not newest or newest[-1][1] != resume_from:
            why = f"{run_path} has newer checkpoints than {resume_from.name}; they are kept"
        else:
            continued = ckpt.RunDirectory.resume(run_path)
            if continued is not None:
                return continued, None
            why = f"{run_path} is not yours or another process is training it"
    return ckpt.RunDirectory.new(directory, created), why


@dataclass
class _Run:
    """What one invocation decided before training starts."""

    args: argparse.Namespace
    settings: RunSettings
    config: infinity.Config
    derived: tuple[str, ...]  # budgets derived from the model (demo budgets)
    corpus: Corpus
    report: HumanReport | JsonReport
    ckpt_dir: Path | None
    resume_from: Path | None
    resumed: ckpt.TrainerState | None
    started: float
    ranks: train_ranks.Ranks
    run_dir: ckpt.RunDirectory | None = None  # this run's own directory in ckpt_dir
    forked: str | None = None  # why a resumed run continues as a new run, if it does
    last_saved: Path | None = None  # the newest complete checkpoint of this run


def _header(run: _Run, session: Session) -> list[str]:
    """What will run, on what text, and where its states live."""
    s, m, corpus = run.settings, run.settings.model, run.corpus
    stats = {**infinity.stats(session.model), "nvme_path": run.config.nvme_path}
    per_tensor = tensor_state_bytes(session.optimizer, session.model.parameters())
    dtype = s.dtype
    if run.args.dtype in (None, "auto") and run.resumed is None:
        dtype = f"{s.dtype} (auto: {choose_dtype(str(stats['device'])).reason})"
    return [
        f"infinity train: {describe(m)}, context {m.seq_len} {corpus.unit}, device "
        f"{stats['device']}, {dtype}",
        f"data: {corpus.files} files of {corpus.about} in {corpus.root} "
        f"({corpus.train.numel() / 1e6:.2f}M {corpus.unit} to train on, "
        f"{corpus.eval.numel() / 1e6:.2f}M held out)",
        f"steps: {s.steps} x {s.batch_size * s.grad_accum} sequences = "
        f"{s.tokens_per_step} tokens/step; {CHOICES[s.optimizer].label} lr {s.lr:g} "
        f"(warmup {s.warmup}, cosine to "
        f"{s.lr * s.min_lr_ratio:g}), {s.optimizer_state_dtype} moments, clip {s.clip_grad:g}, "
        f"seed {s.seed}",
        *budget_lines(s.state_bytes(), stats, bool(run.derived), per_tensor),
        *train_ranks.header_line(run.ranks, s.batch_size * s.grad_accum),
        "plan:",
        *("  " + line for line in engine_of(session.model).plan.describe().splitlines()),
        *("  " + line for line in session.forecast()),
    ]


def budget_lines(
    state_bytes: int, stats: dict[str, Any], demo: bool, tensor_state_bytes: int = 0
) -> list[str]:
    """Model-state bytes against each tier's budget (what makes this run 'beyond memory');
    ``tensor_state_bytes``: the optimizer's per-tensor states (Adafactor's factors), kept
    in host memory inside the host budget but not in chunks, so not in ``state_bytes``."""
    dev, host = stats["device_budget_bytes"], stats["host_budget_bytes"]
    lines = [f"model states  {format_size(state_bytes):>12}  (parameters, gradients, optimizer)"]
    if tensor_state_bytes:
        lines.append(
            f"+ per tensor  {format_size(tensor_state_bytes):>12}  (the optimizer's "
            "factored states: host memory, inside the host budget)"
        )
    lines += [
        f"device budget {format_size(dev):>12}  = {dev / state_bytes:6.1%} of the states",
        f"host budget   {format_size(host):>12}  = {host / state_bytes:6.1%} of the states",
        f"nvme swap     {format_size(stats['nvme_bytes']):>12}  in {stats.get('nvme_path') or '-'}",
    ]
    if demo:
        lines.append(
            "(demo budgets, derived from the model; set --device-memory/--host-memory to change)"
        )
    return lines


def _prepare_nvme(path: str | None) -> list[Path]:
    """Create the NVMe directory (and missing parents); returns what was created."""
    if path is None:
        return []
    target = Path(path).absolute()
    created = ckpt.make_dirs(target, "--nvme-path")
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        raise CommandError(f"--nvme-path: '{target}' is not a writable directory")
    return created


def _open_session(run: _Run) -> Session:
    """Offload the model; derived (demo) budgets grow until the planner accepts them."""
    for attempt in range(DEMO_BUDGET_ATTEMPTS):
        try:
            return Session(run.settings, run.config, run.corpus, run.ranks)
        except infinity.PlanError as exc:
            if not run.derived or attempt == DEMO_BUDGET_ATTEMPTS - 1:
                raise CommandError(as_flags(str(exc))) from None
            run.config = grow_derived(run.config, run.derived, str(exc))
        except infinity.ConfigError as exc:
            raise CommandError(as_flags(str(exc))) from None
        except OSError as exc:
            raise CommandError(
                f"cannot set up the NVMe tier in '{run.config.nvme_path}': {exc}"
            ) from None
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    """Run ``infinity train``; returns the exit code."""
    if train_ranks.wants_launch(args):
        _decide(args)  # NOTE: a bad flag fails here, once, before any process starts
        return train_ranks.launch(args)
    with train_ranks.joined(args) as ranks:
        return _run(args, ranks)


def _decide(
    args: argparse.Namespace,
) -> tuple[Path | None, Path | None, ckpt.TrainerState | None, RunSettings, _Budgets]:
    """Check the flags and derive the run: (resume_from, ckpt_dir, resumed state,
    settings, (config, derived budgets)); touches nothing."""
    if args.checkpoint_every < 0 or args.eval_batches < 0:
        raise CommandError("--checkpoint-every and --eval-batches must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        raise CommandError(f"--stop-after must be a step >= 1, got {args.stop_after}")
    resume_from, ckpt_dir = _resume_point(args)
    resumed = None
    if resume_from is not None:
        try:
            resumed = ckpt.read_state(resume_from)
        except infinity.CheckpointError as exc:
            raise CommandError(f"--resume: {exc}") from None
    settings = resolve_settings(args, resumed.settings if resumed else None)
    if resumed is not None and resumed.step >= settings.steps:
        raise CommandError(
            f"--resume: {resume_from} is at step {resumed.step}, the end of a "
            f"{settings.steps}-step run; pass --steps N with N > {resumed.step} to train further"
        )
    return resume_from, ckpt_dir, resumed, settings, build_config(args, settings)


def _run(args: argparse.Namespace, ranks: train_ranks.Ranks) -> int:
    """The run of this process (one of ``ranks``)."""
    started = time.perf_counter()
    report = train_ranks.report_for(args, ranks)
    resume_from, ckpt_dir, resumed, settings, (config, derived) = _decide(args)
    try:
        if isinstance(settings.model, PretrainedModel):
            corpus = load_pretrained_corpus(settings.model)
        elif settings.data is not None:
            corpus = load_byte_corpus(settings.data, settings.model.seq_len)
        else:
            corpus = load_corpus()
    except CorpusError as exc:
        raise CommandError(str(exc)) from None
    plan = _Run(
        args, settings, config, derived, corpus, report, ckpt_dir, resume_from, resumed, started,
        ranks, last_saved=resume_from,
    )  # fmt: skip
    created = _prepare_nvme(config.nvme_path)
    try:
        if ckpt_dir is not None:
            opened = _open_run_dir(ckpt_dir, resume_from, resumed) if ranks.main else None
            plan.run_dir, plan.forked = train_ranks.share_run_dir(ranks, opened)
        # The handlers cover everything from offload to cleanup, so a second
        # Ctrl-C anywhere abandons the run with the message below, not a traceback.
        with StopSignals(report.note) as stop:
            try:
                session = _open_session(plan)
                try:
                    code = _train(plan, session, stop)
                finally:
                    session.close()
                train_ranks.leave_nvme(ranks, plan.config)
                return code
            except KeyboardInterrupt:
                report.alert(f"interrupted: {stop.interruption}; {_where(plan)}")
                return 128 + (stop.abandon_signum or signal.SIGINT)
    finally:
        if plan.run_dir is not None:
            plan.run_dir.close()
        ckpt.remove_empty(created)


def _where(run: _Run) -> str:
    """Where a stopped run can be continued from."""
    if run.last_saved is None:
        return "no checkpoint was written (pass --checkpoint-dir to keep one)"
    return f"last complete checkpoint: {run.last_saved} (continue with --resume)"


def _save(run: _Run, session: Session, summary: RunSummary) -> None:
    """Checkpoint the current step, unless nothing was trained or it is saved already."""
    if run.run_dir is None or not summary.losses:
        return  # nothing trained in this invocation: the last checkpoint is still current
    if run.last_saved == ckpt.checkpoint_path(run.run_dir.path, session.step):
        return
    try:
        run.last_saved = session.save(run.run_dir)
    except (OSError, infinity.CheckpointError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CommandError(
            f"cannot save the checkpoint of step {session.step} in '{run.run_dir.path}': "
            f"{reason}; nothing was saved for this step; {_where(run)}"
        ) from None
    run.report.event("checkpoint", step=session.step, path=str(run.last_saved))


def _train(run: _Run, session: Session, stop: StopSignals) -> int:
    """The run proper, once the model is offloaded; returns the exit code."""
    args, settings, report = run.args, run.settings, run.report
    if run.resumed is not None:
        assert run.resume_from is not None  # resumed state comes from a checkpoint path
        try:
            session.restore(run.resume_from, run.resumed)
        except infinity.CheckpointError as exc:
            older = [
                path
                for _step, path in ckpt.complete_checkpoints(run.resume_from.parent)
                if path != run.resume_from
            ]
            hint = f"; an older one is {older[-1]} (--resume {older[-1]})" if older else ""
            raise CommandError(f"--resume: {exc}{hint}") from None
    report.start(_header(run, session))
    if run.resumed is not None:
        report.note(f"resumed from {run.resume_from} (step {run.resumed.step})")
    if run.forked is not None and run.run_dir is not None:
        report.note(f"note: saving as a new run in {run.run_dir.path}: {run.forked}")
    elif run.resumed is None and run.ckpt_dir is not None and run.run_dir is not None:
        others = ckpt.latest_checkpoint(run.ckpt_dir)
        if others is not None:
            report.note(
                f"note: {run.ckpt_dir} holds checkpoints of earlier runs (kept); this run "
                f"saves into {run.run_dir.path.name} (pass --resume to continue the newest)"
            )
    summary = RunSummary(
        status="finished",
        first_step=session.step + 1,
        last_step=session.step,
        optimizer=settings.optimizer,
    )

    def stopping() -> bool:  # NOTE: agreed, so every rank stops after the same step
        return run.ranks.any(stop.requested, "agreeing whether to stop")

    if args.eval_batches and not stopping():
        summary.eval_before = session.evaluate(args.eval_batches)
        report.event("eval", step=session.step, loss=summary.eval_before)
    # The memory report measures the steps, not the checkpoint, eval and plot after
    reset_resident_peak()
    reset_device_peak(session.device)
    train_started = time.perf_counter()
    report.begin_steps(session.step + 1, settings.steps)
    while session.step < settings.steps and not stopping():
        record = session.train_step()
        report.step(record)
        summary.add_step(record)
        summary.tokens += session.tokens_per_step
        if args.checkpoint_every and record.step % args.checkpoint_every == 0:
            _save(run, session, summary)
        if args.stop_after is not None and record.step >= args.stop_after:
            summary.status = "stopped"
            break
    summary.train_seconds = time.perf_counter() - train_started
    steps_memory = infinity.stats(session.model)["memory"]
    report.end_steps()
    if stopping():
        summary.status = "interrupted"
    # NOTE: the timeline is taken before evaluating: every eval forward starts a new
    # iteration, and the picture must show a training step.
    timeline = infinity.timeline(session.model) if summary.losses else None
    _save(run, session, summary)
    if args.eval_batches and summary.status == "finished":
        summary.eval_after = session.evaluate(args.eval_batches)
        report.event("eval", step=session.step, loss=summary.eval_after)
    if isinstance(settings.model, PretrainedModel) and summary.status == "finished":
        summary.model_dir = str(save_model(session.model, settings.model))
        report.event("model", path=summary.model_dir)
    summary.stats = {**infinity.stats(session.model), "memory": steps_memory}
    summary.checkpoint = str(run.last_saved) if run.last_saved else None
    summary.ranks = train_ranks.per_rank(run.ranks, summary, summary.stats)
    plot = _none(args.plot)
    if plot and timeline is not None and run.ranks.main:
        title = f"{describe(settings.model)}, {settings.dtype}: memory over one training step"
        with stop.deferred("the plot"):  # it imports matplotlib's native modules
            from infinity.cli.train.timeline_plot import plot_timeline

            summary.plot = str(plot_timeline(timeline, summary.stats, Path(plot), title))
    summary.wall_seconds = time.perf_counter() - run.started
    report.finish(summary)
    if summary.status == "stopped":
        report.note(f"stopped after step {session.step} (--stop-after); {_where(run)}")
    if summary.status == "interrupted":
        report.alert(f"stopped by signal after step {session.step}; {_where(run)}")
        return 128 + (stop.signum or signal.SIGINT)
    return 0
