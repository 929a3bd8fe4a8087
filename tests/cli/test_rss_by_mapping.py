"""bench/rss_by_mapping.py: a process's resident set by mapping, against the kernel's total."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rss_by_mapping.py"


def _module():
    spec = importlib.util.spec_from_file_location("rss_by_mapping", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mappings_are_summed_by_name():
    smaps = """\
7f00-7f10 r-xp 00000000 08:01 42    /usr/lib/libfoo.so
Size:                 64 kB
Rss:                  12 kB
7f10-7f20 r--p 00010000 08:01 42    /usr/lib/libfoo.so
Rss:                   4 kB
7f20-7f30 rw-p 00000000 00:00 0
Rss:                 100 kB
5600-5700 rw-p 00000000 00:00 0     [heap]
Rss:                   8 kB
"""
    totals = _module().resident_by_mapping(smaps)
    assert totals == {"/usr/lib/libfoo.so": 16 * 1024, "[anon]": 100 * 1024, "[heap]": 8 * 1024}


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only: /proc/self/smaps")
def test_the_mappings_add_up_to_the_kernels_resident_set(tmp_path):
    module = _module()
    out = tmp_path / "rss.txt"
    module.report(out)
    status = Path("/proc/self/status").read_text()
    vm_rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    reported = int(out.read_text().splitlines()[1].split()[2])  # "resident now: N MiB"
    assert abs(reported - (vm_rss >> 10)) <= 0.05 * (vm_rss >> 10) + 2
