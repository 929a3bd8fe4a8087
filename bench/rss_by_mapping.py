"""Where a process's resident memory is, by mapping, at its exit (issue 41).

python bench/rss_by_mapping.py OUT.txt -- train --steps 30 [any `python -m infinity` arguments]

Runs ``python -m infinity ARGS`` in this process and, when it exits, writes to
``OUT.txt`` the resident set of every mapped file (shared libraries: CUDA's kernels
and libraries load into host memory lazily, after ``offload`` measured its baseline)
and of the anonymous memory (the heap, torch's allocations, pinned buffers), largest
first, with the peak resident set (``VmHWM``). On the H200 the main job's resident set
was 1.28-1.38x its forecast; this says which mappings the forecast leaves out.
"""

from __future__ import annotations

import atexit
import collections
import runpy
import sys
from pathlib import Path


def resident_by_mapping(smaps: str) -> dict[str, int]:
    """Resident bytes per mapping name in the text of ``/proc/PID/smaps``: a file's
    path, or ``[heap]``, ``[stack]``, ``[anon]`` for anonymous memory."""
    totals: collections.Counter[str] = collections.Counter()
    name = "[anon]"
    for line in smaps.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            name = fields[5] if len(fields) > 5 else "[anon]"
        elif fields[0] == "Rss:":
            totals[name] += int(fields[1]) * 1024
    return dict(totals)


def report(out: Path) -> None:
    """Write this process's resident set by mapping to ``out``."""
    totals = resident_by_mapping(Path("/proc/self/smaps").read_text())
    status = Path("/proc/self/status").read_text()
    peak = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")), "?")
    lines = [
        f"peak resident set (VmHWM): {peak} kB",
        f"resident now: {sum(totals.values()) >> 20} MiB",
    ]
    for name, size in sorted(totals.items(), key=lambda item: -item[1])[:40]:
        lines.append(f"{size >> 20:8d} MiB  {name}")
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    """Register the report, then run ``python -m infinity`` with the arguments after ``--``."""
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit(__doc__)
    atexit.register(report, Path(sys.argv[1]))
    sys.argv = ["infinity", *sys.argv[3:]]
    runpy.run_module("infinity", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
