"""Dynamic loss scaling for fp16: halve on overflow, grow after a run of good steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """The scale fp16 losses are multiplied by before backward.

    On a step whose gradients hold inf/NaN the step is skipped and the scale
    halves (not below ``min_scale``); after ``window`` good steps in a row it
    doubles. The same policy as ``torch.amp.GradScaler``.
    """

    scale: float
    window: int
    min_scale: float
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """Account for one step; ``found_inf`` means it was skipped."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers, for checkpoints."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore from :meth:`state_dict`."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
