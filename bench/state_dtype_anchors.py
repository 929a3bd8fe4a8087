"""Loss of fp32 / bf16 / int8 Adam moments against torch's AdamW and two 8-bit anchors.

``python bench/state_dtype.py --anchors`` runs this grid (see ``main`` there);
``python bench/state_dtype_anchors.py CELL`` runs one cell in this process.

Every cell trains the same model from the same initialisation on the same
batches (the byte-level Python standard-library corpus of
``infinity.data.text``, batches a pure function of the seed and the step) with AdamW
(``weight_decay=0.1``, ``beta1=0.9``) and compares the mean loss of the last
20 steps:

- ``torch``: ``torch.optim.AdamW`` on the model in RAM;
- ``torchao``: ``torchao.optim.AdamW8bit`` (CPU), ``bnb``:
  ``bitsandbytes.optim.AdamW8bit`` (CPU) — the 8-bit anchors, measured here
  only (neither is a dependency of infinity; a missing one is reported);
- ``fp32`` / ``bf16`` / ``int8``: the model through ``infinity.offload`` (in-RAM
  budgets) and ``infinity.optim.CPUAdam`` with ``Config(optimizer_state_dtype=...)``,
  computing in the cell's ``compute`` dtype: ``bf16`` (``Config``'s default, what
  users get: bf16 forward and backward, fp32 masters) or ``fp32``. The torch and
  8-bit anchor cells always compute in fp32 (compute does not change them).

Models: ``llama``, a ``transformers`` Llama (vocabulary 256, hidden 256,
intermediate 688, 4 layers, 4 heads, 2 KV heads, tied embeddings), batches of
8 x 128 bytes; ``gpt``, ``infinity.models.gpt.GPT`` in the shape of the demo's
"small" preset (4 layers, hidden 256, 4 heads, tied), batches of 8 x 128.

A cell's optional seventh field is its seed (default 0): ``torch.manual_seed``
before the model is built and the seed of the batches, the same for every
optimizer of a seed, so a seed is one more draw of initialisation and batch
order. (bf16's stochastic rounding keeps its fixed hash seed.)
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

OPTIMIZERS = ("torch", "torchao", "bnb", "fp32", "bf16", "int8")
ANCHORS = {"torchao": "torchao", "bnb": "bitsandbytes"}  # optimizer -> module it needs
MODELS = ("gpt", "llama")
TAIL = 20  # mean loss of the last TAIL steps


@dataclass(frozen=True)
class Cell:
    """One training run of the grid."""

    model: str
    optimizer: str
    lr: float
    beta2: float
    steps: int
    compute: str = "bf16"  # Config.dtype of the infinity cells
    batch: int = 8
    seq_len: int = 128
    seed: int = 0  # the model's initialisation and the batches (every optimizer alike)

    def key(self) -> str:
        """The run's name on the command line and in the JSON report (seed 0: no seed field)."""
        key = f"{self.model}:{self.optimizer}:{self.lr:g}:{self.beta2:g}:{self.steps}"
        key += f":{self.compute}"
        return key if self.seed == 0 else f"{key}:{self.seed}"

    @classmethod
    def parse(cls, key: str) -> Cell:
        """Inverse of :meth:`key`: ``model:optimizer:lr:beta2:steps:compute[:seed]``."""
        model, optimizer, lr, beta2, steps, compute, *seed = key.split(":")
        if len(seed) > 1:
            raise ValueError(f"{key!r}: model:optimizer:lr:beta2:steps:compute[:seed]")
        return cls(
            model, optimizer, float(lr), float(beta2), int(steps), compute,
            seed=int(seed[0]) if seed else 0,
        )  # fmt: skip


def missing_anchors() -> dict[str, str]:
    """Anchor optimizers whose package is not installed: name -> package."""
    return {opt: mod for opt, mod in ANCHORS.items() if importlib.util.find_spec(mod) is None}


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=128,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)
    from infinity.models.gpt import GPT, GPTConfig, init_weights

    model = GPT(GPTConfig(vocab_size=256, seq_len=128, layers=4, hidden=256, heads=4))
    model.apply(init_weights)
    return model


def _loss(model: torch.nn.Module, llama: bool, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if llama:
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return model(x, y)


def _optimizer(cell: Cell, model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    hyper: dict[str, Any] = dict(lr=cell.lr, betas=(0.9, cell.beta2), weight_decay=0.1)
    if cell.optimizer == "torch":
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    if cell.optimizer == "torchao":
        from torchao.optim import AdamW8bit

        return model, AdamW8bit(model.parameters(), **hyper)
    if cell.optimizer == "bnb":
        import bitsandbytes

        return model, bitsandbytes.optim.AdamW8bit(model.parameters(), **hyper)
    import infinity
    from infinity.optim import CPUAdam

    config = infinity.Config(
        device="cpu", dtype=cell.compute, device_memory="1GiB", host_memory="2GiB",
        optimizer_state_dtype=cell.optimizer,
    )  # fmt: skip
    model = infinity.offload(model, config)
    return model, CPUAdam(model.parameters(), **hyper)


def run_cell(cell: Cell) -> dict[str, Any]:
    """Train one cell; its losses per step and seconds per step."""
    from infinity.data.text import Batches, load_corpus

    torch.set_num_threads(1)  # the grid runs one cell per core
    data = Batches(load_corpus().train, cell.seq_len, cell.batch, seed=cell.seed)
    model, opt = _optimizer(cell, _model(cell.model, cell.seed))
    losses = []
    start = time.perf_counter()
    for step in range(cell.steps):
        x, y = data.get(step)
        loss = _loss(model, cell.model == "llama", x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    seconds = (time.perf_counter() - start) / len(losses)
    return {"cell": cell.key(), "losses": losses, "step_seconds": seconds}


def tail(losses: list[float]) -> float:
    """Mean loss of the last :data:`TAIL` steps (one step's loss is one batch's: noisy)."""
    return sum(losses[-TAIL:]) / len(losses[-TAIL:])


def tails(results: dict[str, dict[str, Any]], cells: list[Cell]) -> dict[tuple, dict[str, float]]:
    """Each optimizer's tail loss per (model, lr, beta2, seed) of the cells that ran."""
    groups: dict[tuple, dict[str, float]] = {}
    for cell in cells:
        res = results.get(cell.key())
        if res is not None:
            group = groups.setdefault((cell.model, cell.lr, cell.beta2, cell.seed), {})
            group[cell.optimizer] = tail(res["losses"])
    return groups


def mean_tails(groups: dict[tuple, dict[str, float]]) -> dict[tuple, dict[str, float]]:
    """The tail losses of :func:`tails` averaged over the seeds, per (model, lr, beta2)
    and optimizer (an optimizer's mean over the seeds it ran)."""
    runs: dict[tuple, dict[str, list[float]]] = {}
    for (model, lr, beta2, _seed), row in groups.items():
        for opt, loss in row.items():
            runs.setdefault((model, lr, beta2), {}).setdefault(opt, []).append(loss)
    return {
        key: {opt: sum(losses) / len(losses) for opt, losses in row.items()}
        for key, row in runs.items()
    }


def judge(row: dict[str, float]) -> dict[str, float | bool]:
    """The goal on one row of tail losses: the worse anchor's excess over torch, bf16's and
    int8's over fp32, the limit min(1%, anchor + 0.5%) and whether both are within it."""
    anchors = [row[o] / row["torch"] - 1 for o in ANCHORS if o in row and "torch" in row]
    worst = max(anchors) if anchors else math.nan
    excess = {d: row[d] / row["fp32"] - 1 if d in row and "fp32" in row else math.nan
              for d in ("bf16", "int8")}  # fmt: skip
    limit = min(0.01, worst + 0.005) if anchors else 0.01
    ok = all(e <= limit for e in excess.values() if not math.isnan(e))
    return {"anchor": worst, "bf16": excess["bf16"], "int8": excess["int8"], "limit": limit,
            "ok": ok}  # fmt: skip


def rows(groups: dict[tuple, dict[str, float]], limit: bool = False) -> list[str]:
    """Rows of a table of tail losses keyed (model, lr, beta2[, seed]): each optimizer's
    tail loss, the worse anchor's excess over torch, and bf16's / int8's over fp32
    (``limit``: and the goal's limit on those two)."""
    seeds = any(len(key) > 3 for key in groups)
    head = f"{'model':<6}{'lr':>7}{'beta2':>7}" + (f"{'seed':>5}" if seeds else "")
    lines = [head + "".join(f"{o:>9}" for o in OPTIMIZERS)
             + f"{'anchor':>9}{'bf16':>9}{'int8':>9}" + (f"{'limit':>9}" if limit else "")
             + f"{'goal':>7}"]  # fmt: skip
    for key, row in groups.items():
        model, lr, beta2 = key[:3]
        cols = "".join(f"{row[o]:>9.4f}" if o in row else f"{'-':>9}" for o in OPTIMIZERS)
        goal = judge(row)
        lines.append(
            f"{model:<6}{lr:>7g}{beta2:>7g}" + (f"{key[3]:>5}" if seeds else "") + cols
            + f"{goal['anchor']:>+9.2%}{goal['bf16']:>+9.2%}{goal['int8']:>+9.2%}"
            + (f"{goal['limit']:>+9.2%}" if limit else "")
            + f"{'ok' if goal['ok'] else 'MISS':>7}"
        )  # fmt: skip
    return lines


LEGEND = (
    "anchor: the worse 8-bit anchor's loss over torch's; bf16, int8: over infinity fp32's; "
    "goal: both at most min(1%, anchor + 0.5%)"
)


def table(results: dict[str, dict[str, Any]], cells: list[Cell]) -> list[str]:
    """Rows of the grid: per (model, lr, beta2), each optimizer's tail loss, the
    worse anchor's excess over torch, and bf16's / int8's excess over fp32.

    With one seed per (model, lr, beta2), one row each (no seed column). With
    several: a row per seed, then the rows of the means over the seeds (each
    optimizer's tail loss averaged), on which the goal is judged."""
    groups = tails(results, cells)
    seeds = sorted({key[3] for key in groups})
    if len(seeds) <= 1:
        return [*rows({key[:3]: row for key, row in groups.items()}), LEGEND]
    means = mean_tails(groups)
    spread = []
    for model, lr, beta2 in means:
        gap = [row["fp32"] / row["torch"] - 1 for key, row in groups.items()
               if key[:3] == (model, lr, beta2) and "fp32" in row and "torch" in row]  # fmt: skip
        if gap:
            spread.append(
                f"{model} {lr:g} {beta2:g}: fp32 moments vs torch per seed "
                + ", ".join(f"{g:+.2%}" for g in gap)
                + f" (spread {max(gap) - min(gap):.2%})"
            )
    return [
        *rows(dict(sorted(groups.items())), limit=True),
        f"mean over seeds {', '.join(map(str, seeds))} (the goal is judged on these rows):",
        *rows(means, limit=True),
        LEGEND,
        *spread,
    ]


def main() -> int:
    """Run the cells named on the command line; one JSON line each."""
    for key in sys.argv[1:]:
        print(json.dumps(run_cell(Cell.parse(key))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
