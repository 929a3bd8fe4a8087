"""Streaming, atomic checkpoints of an offloaded model and its optimizer."""

from infinity.checkpoint.format import CheckpointError
from infinity.checkpoint.load import load_checkpoint
from infinity.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
