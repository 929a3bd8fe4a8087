"""Fixtures of the optimizer tests: every test starts with the kernel's default ISA and threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infinity.optim import kernels


@pytest.fixture(autouse=True)
def _default_kernel_config() -> Iterator[None]:
    kernels.force_isa(None)
    threads = kernels.get_num_threads()
    yield
    kernels.force_isa(None)
    kernels.set_num_threads(threads)
