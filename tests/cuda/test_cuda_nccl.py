"""The data-parallel path over NCCL, at the one world size one GPU allows.

NOTE: NCCL refuses two ranks on one GPU, so with one GPU the sharded engine
(two or more ranks) cannot run; what can run is checked: the shard
collectives on GPU tensors through an NCCL group (the engine's ``Collectives``
with a world built by hand, its gloo twin for host memory), and an offloaded
model under an initialised NCCL group of one process, which must train like
plain PyTorch (the world of one is the single-process engine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from cuda_helpers import needs_cuda
from sweep_cases import PINNED
from sweep_run import judge, run_case

from infinity.distributed.collectives import Collectives, World, resolve_world

pytestmark = needs_cuda


@pytest.fixture
def nccl_group(tmp_path):
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_shard_collectives_run_on_gpu_tensors_over_nccl(nccl_group):
    gloo = dist.new_group([0], backend="gloo")
    world = World(rank=0, size=1, group=nccl_group, host_group=gloo)
    coll = Collectives(world)
    full = torch.arange(4096, dtype=torch.float32, device="cuda")
    expected = full.clone()
    coll.start_all_gather(full, "test gather").wait_for_compute()
    assert torch.equal(full, expected)
    out = torch.empty(4096, device="cuda")
    coll.reduce_scatter_mean(out, full * 3, "test reduce")
    assert torch.equal(out, expected * 3)
    coll.broadcast(out, "test broadcast")
    host = torch.ones(8)
    coll.broadcast(host, "test broadcast on host")  # host memory goes over the gloo twin
    assert coll.sum(2.5, "test sum") == 2.5
    assert coll.bytes_sent == 4096 * 4 * 2


def test_an_nccl_group_of_one_trains_like_plain_pytorch(nccl_group, tmp_path):
    assert not resolve_world().sharded
    case = dataclasses.replace(PINNED[0], backend="cuda")  # every kind on NVMe
    verdict = judge(run_case(case, str(tmp_path)))
    assert verdict.ok, verdict.message
