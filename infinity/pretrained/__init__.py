"""Pretrained checkpoints in and out: empty init, safetensors load/save, ``transformers``."""

from infinity.pretrained.empty_init import init_empty
from infinity.pretrained.load import LoadResult, load_pretrained
from infinity.pretrained.safetensors_io import PretrainedError
from infinity.pretrained.save import save_pretrained

__all__ = ["LoadResult", "PretrainedError", "init_empty", "load_pretrained", "save_pretrained"]
