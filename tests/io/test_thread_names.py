"""Our native threads carry names, so top, py-spy and /proc tell them apart.

Each check starts one kind of thread in a fresh interpreter and reads the
names back from /proc/self/task/*/comm, which the kernel keeps.
"""

from __future__ import annotations

import json

import pytest
from io_helpers import run_python

from infinity.io import available_backends

NAMES = """
import json, os
def names():
    out = []
    for t in os.listdir('/proc/self/task'):
        with open(f'/proc/self/task/{t}/comm') as f:
            out.append(f.read().strip())
    return out
"""


def _names_after(setup: str) -> list[str]:
    result = run_python(NAMES + setup + "\nprint(json.dumps(names()))")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", available_backends())
def test_io_worker_threads_are_named(backend):
    names = _names_after(
        "from infinity.io import IOEngine\n"
        f"eng = IOEngine({{'backend': '{backend}', 'threads': 2, 'queue_depth': 4}})"
    )
    assert names.count("inf-io") == 2, names
    if backend == "threads":
        assert "inf-io-helper" in names, names


def test_copy_and_compute_threads_are_named():
    names = _names_after(
        "from infinity.devices.cpu import CpuBackend\n"
        "from infinity.optim import kernels\n"
        "b = CpuBackend()\n"
        "import torch\n"
        "kernels.set_num_threads(3)\n"
        "p, g, m, v = (torch.zeros(1 << 16) for _ in range(4))\n"
        "kernels.adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)"
    )
    assert names.count("inf-copy") == 1, names
    assert names.count("inf-compute") == 2, names
