"""Loading a pretrained checkpoint: ``infinity.from_pretrained`` vs ``transformers``.

Writes a Llama-shaped checkpoint with ``transformers`` (fp32, sharded), then
loads it in fresh subprocesses, one per loader, and prints the seconds, the
RSS before and after, and the peak RSS (``VmHWM``, reset before loading):
``transformers`` holds the model in RAM; infinity streams it into chunks
within its budgets (NVMe on).

python bench/pretrained_load.py [--hidden 512 --layers 16 --vocab 8192] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

LOADERS = {
    "transformers": """
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    """,
    "infinity": """
        cfg = infinity.Config(device="cpu", dtype="fp32", device_memory="40MiB",
                              host_memory="112MiB", nvme_path=nvme)
        model = infinity.from_pretrained(path, cfg)
    """,
}

RUN = """
import json, re, sys, time, torch, transformers, infinity
path, nvme = sys.argv[1], sys.argv[2]

def status_mib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1]) / 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak: imports peaked higher than they end
base = status_mib("VmRSS")
start = time.perf_counter()
{loader}
seconds = time.perf_counter() - start
peak, after = round(status_mib("VmHWM")), round(status_mib("VmRSS"))
print(json.dumps({{"seconds": round(seconds, 2), "rss_before_mib": round(base),
                  "peak_mib": peak, "rss_after_mib": after}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        )  # fmt: skip
        path = Path(work) / "model"
        transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100MB")
        size = sum(p.stat().st_size for p in path.glob("*.safetensors")) / 2**20
        results = {"checkpoint_mib": round(size, 1)}
        for name, loader in LOADERS.items():
            nvme = Path(work) / f"nvme-{name}"
            nvme.mkdir()
            code = RUN.format(loader=textwrap.indent(textwrap.dedent(loader), ""))
            out = subprocess.run(
                [sys.executable, "-c", code, str(path), str(nvme)],
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode != 0:
                sys.exit(f"{name} failed:\n{out.stderr[-2000:]}")
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
