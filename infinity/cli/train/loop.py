"""The training session behind ``infinity train``: model, optimizer, schedule, one step.

Only public API: ``infinity.offload`` builds the model straight into chunks
(from the ``meta`` device, so it never exists whole in RAM), ``CPUAdam`` (or
``CPULion``, ``CPUSGD``, ``CPUAdafactor``: ``--optimizer``) steps it, a torch
``LambdaLR`` drives warmup + cosine, and ``infinity.stats`` gives the bytes each step moved.
"""

from __future__ import annotations

import math
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType

import torch

import infinity
from infinity.cli.train import checkpoints as ckpt
from infinity.cli.train import optimizers as train_optimizers
from infinity.cli.train import ranks as train_ranks
from infinity.cli.train.pretrained import PretrainedModel, build_model, causal_lm_loss
from infinity.cli.train.report import BOUND_KEYS, TRAFFIC_KEYS, WAIT_KEYS, StepRecord
from infinity.cli.train.settings import RunSettings
from infinity.data import Corpus
from infinity.models.gpt import GPT, init_weights
from infinity.offload import find_engine

EVAL_SEED_OFFSET = 1_000_003
COUNTER_KEYS = TRAFFIC_KEYS + WAIT_KEYS  # held-out batches never share a stream with training ones


def lr_factor(done: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR after ``done`` steps: linear warmup, then cosine decay."""
    if done < warmup:
        return (done + 1) / warmup
    progress = min(1.0, (done - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StopSignals:
    """Ctrl-C (or SIGTERM) once: stop after the current step. Twice: abandon it now."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Callable[[str], None]) -> None:
        self.signum: int | None = None
        self.abandon_signum: int | None = None  # the second signal: 128 + it is the exit code
        self._on_first = on_first
        self._previous: dict[int, object] = {}
        self._deferring = ""  # what deferred() protects now, if anything
        self.interruption = "the current step was abandoned"  # what the second signal did

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.abandon_signum is not None:
            return  # NOTE: a third signal must not interrupt the clean-up of the second
        if self.signum is not None:
            self.abandon_signum = signum
            if not self._deferring:
                raise KeyboardInterrupt  # second signal: abandon the step
            self.interruption = f"stopped after {self._deferring}"
            return
        self.signum = signum
        self._on_first("stopping after this step (press Ctrl-C again to abandon it)")

    @contextmanager
    def deferred(self, what: str) -> Iterator[None]:
        """A region (doing ``what``) a second signal must not interrupt midway: it
        abandons the run when the region ends instead (raising ``KeyboardInterrupt``).

        NOTE: for lazy imports of native extension modules (matplotlib's, for the
        plot). A ``KeyboardInterrupt`` raised inside a module's initialisation
        came out as "ImportError: initialization failed", and the half-built
        module then aborted the interpreter at exit (SIGABRT instead of exit 130).
        """
        self._deferring = what
        try:
            yield
        finally:
            self._deferring = ""
        if self.abandon_signum is not None:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signum is not None

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _gpt_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets)


class Session:
    """An offloaded model (the built-in GPT, or a pretrained one with ``--model``) with
    its optimizer, LR schedule and data streams."""

    def __init__(
        self,
        settings: RunSettings,
        config: infinity.Config,
        corpus: Corpus,
        ranks: train_ranks.Ranks = train_ranks.SINGLE,
    ) -> None:
        self.settings = settings
        self.ranks = ranks
        self.tokens_per_step = settings.tokens_per_step * ranks.size  # over all ranks
        self.run_id = uuid.uuid4().hex[:12]
        self.step = 0  # optimizer steps done
        self.tokens = 0
        self.last_loss: float | None = None
        torch.manual_seed(settings.seed)  # the initial weights follow --seed
        if isinstance(settings.model, PretrainedModel):
            self.model = build_model(settings.model, config)
            self.loss = causal_lm_loss
        else:
            with torch.device("meta"):
                model = GPT(settings.model)
            self.model = infinity.offload(model, config, init=init_weights)
            self.loss = _gpt_loss
        try:
            self.optimizer = train_optimizers.build(
                settings.optimizer,
                self.model.parameters(),
                lr=settings.lr,
                weight_decay=settings.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                lambda done: lr_factor(
                    done, settings.warmup, settings.steps, settings.min_lr_ratio
                ),
            )
        except BaseException:
            self.close()
            raise
        # Batches are built on the host; every one moves to the engine's device
        # (a GPU, or the fence in tests) before the model sees it.
        self.device = infinity.device_of(self.model)
        m = settings.model
        self.batches = ranks.batches(
            corpus.train, m.seq_len, settings.batch_size, settings.seed, corpus.train_mask
        )
        self.eval_batches = ranks.batches(
            corpus.eval,
            m.seq_len,
            settings.batch_size,
            settings.seed + EVAL_SEED_OFFSET,
            corpus.eval_mask,
        )
        self._traffic = self._snapshot()

    def forecast(self) -> list[str]:
        """The forecast of a step's peak per tier (lines for the header): its working set
        from a fake step at this run's batch shape (nothing computed or allocated)."""
        s = self.settings
        ids = torch.zeros((s.batch_size, s.model.seq_len), dtype=torch.long, device=self.device)
        try:
            forecast = infinity.memory_forecast(
                self.model, lambda model: self.loss(model, ids, ids), ids.numel()
            )
        except Exception as exc:  # a report, never a reason to stop the run
            return [f"memory forecast: not available ({type(exc).__name__}: {exc})"]
        return forecast.describe()

    # --- state ----------------------------------------------------------------------------
    def restore(self, path: Path, state: ckpt.TrainerState) -> None:
        """Continue the run saved at ``path``: weights, optimizer, schedule, RNG, counters."""
        infinity.load_checkpoint(path, self.model, self.optimizer)  # CRC-checked
        self.scheduler.load_state_dict(state.scheduler)
        # NOTE: the schedule may have changed (a larger --steps, a new --lr); the LR of
        # the next step is the current schedule's value at this step, not the one saved.
        s = self.settings
        factor = lr_factor(state.step, s.warmup, s.steps, s.min_lr_ratio)
        self.scheduler.base_lrs = [s.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = s.lr
            group["lr"] = s.lr * factor
        torch.set_rng_state(torch.frombuffer(bytearray(state.rng), dtype=torch.uint8))
        self.run_id = state.run_id
        self.step = state.step
        self.tokens = state.tokens
        self.last_loss = state.last_loss

    def trainer_state(self) -> ckpt.TrainerState:
        """What a checkpoint needs besides the model and optimizer states."""
        return ckpt.TrainerState(
            step=self.step,
            run_id=self.run_id,
            settings=self.settings,
            scheduler=self.scheduler.state_dict(),
            rng=bytes(torch.get_rng_state().numpy()),
            tokens=self.tokens,
            last_loss=self.last_loss,
        )

    def save(self, run: ckpt.RunDirectory) -> Path:
        """Write a checkpoint of the current step into the run's directory."""
        return ckpt.save(run, self.model, self.optimizer, self.trainer_state())

    # --- work -----------------------------------------------------------------------------
    def _on_device(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device) for t in batch)

    def _snapshot(self) -> dict[str, float]:
        stats = {**infinity.stats(self.model), "sent_bytes": train_ranks.bytes_sent(self.model)}
        return {k: stats[k] for k in COUNTER_KEYS}

    def train_step(self) -> StepRecord:
        """One optimizer step over ``grad_accum`` micro-batches."""
        s = self.settings
        started = time.perf_counter()
        step = self.step + 1
        lr = self.optimizer.param_groups[0]["lr"]
        total = 0.0
        for micro in range(s.grad_accum):
            inputs, targets = self._on_device(self.batches.get(step, micro))
            loss = self.loss(self.model, inputs, targets)
            self.optimizer.scale_loss(loss / s.grad_accum).backward()
            total += loss.item()
        norm = None
        if s.clip_grad > 0:
            norm = float(self.optimizer.clip_grad_norm_(s.clip_grad))
        before = infinity.stats(self.model).get("skipped_steps", 0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        skipped = infinity.stats(self.model).get("skipped_steps", 0) > before
        self.step = step
        self.tokens += self.tokens_per_step
        self.last_loss = self.ranks.mean(total / s.grad_accum, "averaging the loss")
        seconds = time.perf_counter() - started
        stats = infinity.stats(self.model)
        last = {**stats["last_step"], "bound_by": stats["last_step_bound_by"]}
        counters = self._snapshot()
        delta = {k: counters[k] - self._traffic[k] for k in COUNTER_KEYS}
        self._traffic = counters
        return StepRecord(
            step=step,
            loss=self.last_loss,
            lr=lr,
            seconds=seconds,
            tokens_per_second=self.tokens_per_step / max(seconds, 1e-9),
            traffic={k: int(delta[k]) for k in TRAFFIC_KEYS},
            waits={k: delta[k] for k in WAIT_KEYS},
            grad_norm=None if norm is None or not math.isfinite(norm) else norm,
            skipped=skipped,
            bound={k: last[k] for k in BOUND_KEYS if k in last},
        )

    @torch.no_grad()
    def evaluate(self, batches: int) -> float:
        """Mean loss over ``batches`` fixed held-out batches (the same ones every time)."""
        self.model.eval()  # no dropout in the held-out loss
        try:
            losses = [
                self.loss(self.model, *self._on_device(self.eval_batches.get(i))).item()
                for i in range(batches)
            ]
        finally:
            self.model.train()
        self._traffic = self._snapshot()  # evaluation traffic is not a training step's
        return self.ranks.mean(sum(losses) / len(losses), "averaging the held-out loss")

    def close(self) -> None:
        """Release the engine: threads stop and the swap files are removed."""
        engine = find_engine(self.model)
        if engine is not None:
            engine.close()
