"""How many of infinity's Python modules one training step passes through (issue 42).

A small GPT with every state kind partly on NVMe (so a step reads and writes the
swap file), two warm-up steps, then the third step (forward, backward,
``optimizer.step()``, ``zero_grad``) under ``sys.setprofile``: the modules of
``infinity`` whose functions ran (the model's own, ``infinity/models``, left out),
and how many lines they hold. Run it on two
checkouts to compare them::

    python bench/step_modules.py [--list]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import infinity
from infinity.models.gpt import GPT, GPTConfig


def _step_modules(nvme: str) -> dict[str, int]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=32, layers=4, hidden=64, heads=4)
    model = GPT(cfg)
    pbytes = sum(p.numel() for p in model.parameters()) * 4
    config = infinity.Config(
        device="cpu",
        dtype="fp32",
        device_memory=pbytes // 2,
        host_memory=pbytes * 2,
        nvme_path=nvme,
        chunk_size="32KiB",
    )
    model = infinity.offload(model, config)
    optimizer = infinity.optim.CPUAdam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 32))

    def step() -> None:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    root = Path(infinity.__file__).parent
    seen: dict[str, int] = {}

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(root)) and path not in seen and "/models/" not in path:
                seen[path] = sum(1 for _ in open(path))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    stats = infinity.stats(model)["last_step"]
    assert stats["nvme_read_bytes"] > 0 and stats["nvme_write_bytes"] > 0, stats
    return {str(Path(p).relative_to(root.parent)): n for p, n in sorted(seen.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print each module and its lines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as nvme:
        modules = _step_modules(nvme)
    if args.list:
        for path, lines in modules.items():
            print(f"{lines:5d}  {path}")
    engine = [p for p in modules if p.startswith(("infinity/runtime/", "infinity/chunks/"))]
    print(
        f"one step passes through {len(modules)} modules of infinity "
        f"({sum(modules.values())} lines); {len(engine)} of them in runtime/ and chunks/"
    )


if __name__ == "__main__":
    main()
