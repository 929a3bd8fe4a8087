"""Integrations with training libraries (imported on demand: each needs its library).

- :mod:`infinity.integrations.hf_trainer`: ``transformers.Trainer`` checkpoints that
  stream (``StreamedCheckpoints``, ``Trainer``).
"""
