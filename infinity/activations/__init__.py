"""Activations in the tiers: what autograd saves for backward, checkpointed or offloaded.

- :mod:`.blocks`: which modules are a model's repeated blocks;
- :mod:`.checkpointing`: recompute each block's forward in backward;
- :mod:`.store`: saved tensors moved to host memory and, beyond it, to NVMe
  (:mod:`.spill`), read back in reverse order ahead of backward;
- :mod:`.estimate`: the bytes a step saves, from a forward on fake tensors.
"""
