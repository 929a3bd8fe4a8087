"""The whole suite: ``tests/fence/`` runs only in a pytest process of its own.

NOTE [the fence device] (docs/NOTES.md): loading the fence device registers
PyTorch's one ``PrivateUse1`` backend for the rest of the process, and
``torch.accelerator`` then reports it as a GPU machine reports ``cuda``. The
other tests must not run in such a process, so ``make test`` runs
``INFINITY_FENCE_TESTS=1 pytest tests/fence`` after ``pytest tests``, and
without that variable the folder is not collected at all (not skipped).
"""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("INFINITY_FENCE_TESTS") == "1" else ["fence"]
