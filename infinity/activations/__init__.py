"""Activations in the tiers: what autograd saves for backward, checkpointed or offloaded.

- :mod:`.blocks`: which modules are a model's repeated blocks;
- :mod:`.checkpointing`: recompute each block's forward in backward;
- :mod:`.store`: saved tensors moved to host memory and, beyond it, to NVMe
  (:mod:`.spill`), read back in reverse order ahead of backward;
- :mod:`.trace`: the bytes each forward saved, measured, in all and per block;
- :mod:`.policy`: what the engine's hooks talk to: routes saved tensors, refuses a
  forward too large to fit before it runs, and chooses per block under ``"auto"``;
- :mod:`.estimate`: the bytes a step saves, from a forward on fake tensors.
"""
