"""What ``torch.nn.utils.clip_grad_norm_`` costs on an offloaded model.

Three cases on the same GPT (fp32, CPU backend): the plain model (torch on real
``.grad`` tensors), an offloaded model with gradients homed in host memory (the
norm is one read of the gradient chunks; the clip factor costs nothing: it is
folded into the step's kernel), and one with gradients on NVMe (the norm reads
the gradient chunks the staging cache does not hold; printed: the extra NVMe
bytes read per step, clip+step against step alone).

Usage:
    python bench/clip_norm.py [--layers 6] [--hidden 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from torch.nn.utils import clip_grad_norm_

import infinity
from infinity.models.gpt import GPT, GPTConfig, init_weights
from infinity.offload import engine_of
from infinity.optim import CPUAdam


def _clip_ms(model, batch, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        model(*batch).backward()
        start = time.perf_counter()
        clip_grad_norm_(model.parameters(), 1.0)
        times.append(time.perf_counter() - start)
        model.zero_grad()
    return 1000 * statistics.median(times)


def _nvme_read_per_step(model, batch, clip: bool, repeat: int) -> float:
    opt = CPUAdam(model.parameters())
    reads = []
    for _ in range(repeat):
        model(*batch).backward()
        before = infinity.stats(model)["nvme_read_bytes"]
        if clip:
            clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        model(*batch)  # the step trailing into the next forward settles here
        reads.append(infinity.stats(model)["nvme_read_bytes"] - before)
    return statistics.median(reads) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, seq_len=64, layers=args.layers, hidden=args.hidden, heads=4)
    base = GPT(cfg)
    base.apply(init_weights)
    batch = (torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64)))
    pbytes = sum(p.numel() for p in base.parameters()) * 4
    print(f"GPT {pbytes / 2**20:.1f} MiB of fp32 parameters")
    plain_ms = _clip_ms(copy.deepcopy(base), batch, args.repeat)
    print(f"plain clip_grad_norm_:             {plain_ms:.1f} ms")
    host = infinity.offload(
        copy.deepcopy(base), infinity.Config(device="cpu", device_memory=pbytes // 2)
    )
    print(f"offloaded, gradients in host RAM:  {_clip_ms(host, batch, args.repeat):.1f} ms")
    with tempfile.TemporaryDirectory() as swap:
        nvme_cfg = infinity.Config(
            device="cpu", device_memory=pbytes // 2, host_memory=int(pbytes * 1.2), nvme_path=swap
        )
        nvme = infinity.offload(copy.deepcopy(base), nvme_cfg)
        print(f"offloaded, gradients on NVMe:      {_clip_ms(nvme, batch, args.repeat):.1f} ms")
        plain_step = _nvme_read_per_step(nvme, batch, False, args.repeat)
        clip_step = _nvme_read_per_step(nvme, batch, True, args.repeat)
        print(f"NVMe read per step: step {plain_step:.1f} MiB, clip+step {clip_step:.1f} MiB")
        engine_of(nvme).close()  # before its swap directory goes


if __name__ == "__main__":
    main()
