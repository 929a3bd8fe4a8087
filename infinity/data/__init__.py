"""Training data the ``infinity train`` command uses (nothing offload-specific)."""

from infinity.data.text import Batches, Corpus, CorpusError, load_corpus

__all__ = ["Batches", "Corpus", "CorpusError", "load_corpus"]
