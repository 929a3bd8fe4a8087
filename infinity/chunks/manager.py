"""The chunk manager: the one owner of placement, transfers and byte accounting.

It moves chunk bytes between tiers and nothing else: which chunk is needed when
is decided above it (runtime hooks, the prefetcher, the optimizer pipeline).

Data flow: parameters go home -> (host staging, if the home is NVMe) -> device;
gradients go device -> host home (adding to what earlier micro-batches left) or
-> host staging -> NVMe; optimizer units and updated parameters go between
their homes and the optimizer through host staging.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from infinity.chunks.accounting import TierAccount, Traffic
from infinity.chunks.cache import Copy, TierCache
from infinity.chunks.homes import HomeStore, Key, Kind
from infinity.chunks.pools import SlabPool
from infinity.devices.base import DeviceBackend
from infinity.schedule.eviction import EvictionPolicy, LRUPolicy
from infinity.schedule.planner import HOST, Plan


def typed(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a uint8 region as a flat tensor of ``dtype``."""
    return region.view(dtype)


class ChunkManager:
    """Places chunk copies in the device and host tiers and accounts every byte."""

    def __init__(
        self,
        plan: Plan,
        dtype: torch.dtype,
        backend: DeviceBackend,
        swap_file=None,
        device_policy: EvictionPolicy | None = None,
    ) -> None:
        self.plan = plan
        self.dtype = dtype
        self.backend = backend
        self.traffic = Traffic()
        self.device_account = TierAccount("device", plan.budgets.device)
        self.host_account = TierAccount("host", plan.budgets.host)
        self.nvme_account = TierAccount("nvme", plan.budgets.nvme)
        self.homes = HomeStore(plan, backend.alloc_host, self.host_account, self.traffic, swap_file)
        self.nvme_account.reserved = plan.nvme_bytes
        self.nvme_account.add(plan.nvme_bytes)
        self.moment = 0
        device_pools = {
            size: SlabPool("device", size, count, backend.alloc_device)
            for size, count in plan.device_slots.items()
        }
        self.device_account.reserved = sum(p.reserved_bytes for p in device_pools.values())
        self.device = TierCache(
            "device",
            device_pools,
            device_policy or LRUPolicy(),
            self.device_account,
            self._write_back_device,
        )
        self.staging: dict[Kind, TierCache] = {}
        for kind in Kind:
            pools = {
                size: SlabPool("host", size, count, backend.alloc_host)
                for size, count in plan.host_staging.get(kind.value, {}).items()
            }
            self.host_account.reserved += sum(p.reserved_bytes for p in pools.values())
            self.staging[kind] = TierCache(
                "host", pools, LRUPolicy(), self.host_account, self._write_back_staged
            )
        n = plan.layout.num_chunks
        # Gradient homes hold data of the current accumulation cycle only when valid.
        self.grad_valid = [False] * n
        self.found_inf = False
        self.check_overflow = False

    # --- helpers -----------------------------------------------------------------
    def nbytes(self, key: Key) -> int:
        """Bytes of ``key`` in any tier."""
        return self.homes.nbytes(key)

    def _staged(self, key: Key, *, load: bool) -> Copy:
        """A host staging copy of an NVMe-homed key, read from NVMe if ``load``."""
        cache = self.staging[key[0]]
        copy = cache.get(key)
        if copy is None:
            copy = cache.insert(key, self.nbytes(key), self.moment)
            if load:
                copy.pending.append(self.homes.read(key, copy.tensor))
        cache.touch(key, self.moment)
        with self.traffic.waiting("nvme"):
            copy.wait()
        return copy

    def host_source(self, key: Key) -> tuple[torch.Tensor, Copy | None]:
        """Host bytes of ``key`` (its home, or a staged copy read from NVMe)."""
        if self.homes.tier(key) == HOST:
            return self.homes.host(key), None
        copy = self._staged(key, load=True)
        return copy.tensor, copy

    # --- device tier -------------------------------------------------------------
    def param_on_device(self, i: int) -> Copy:
        """Parameter chunk ``i`` resident on the device (fetched if needed)."""
        key = (Kind.PARAM, i)
        copy = self.device.get(key)
        if copy is None:
            copy = self.device.insert(key, self.nbytes(key), self.moment)
            src, staged = self.host_source(key)
            handle = self.backend.copy_async(copy.tensor, src)
            copy.pending.append(handle)
            if staged is not None:
                staged.pending.append(handle)  # the staging slot is read until the copy ends
            self.traffic.h2d_bytes += self.nbytes(key)
        self.device.touch(key, self.moment)
        if copy.pending:
            with self.traffic.waiting("device"):
                copy.wait()
        return copy

    def grad_on_device(self, i: int) -> Copy:
        """Gradient chunk ``i`` on the device (a zeroed slot if it has none)."""
        key = (Kind.GRAD, i)
        copy = self.device.get(key)
        if copy is None:
            copy = self.device.insert(key, self.nbytes(key), self.moment)
            copy.tensor.zero_()
            copy.dirty = True
        self.device.touch(key, self.moment)
        return copy

    def flush_grad(self, i: int) -> None:
        """Move gradient chunk ``i`` off the device, adding it to its home."""
        if (Kind.GRAD, i) in self.device:
            self.device.evict((Kind.GRAD, i))

    def flush_all_grads(self) -> None:
        """Flush every gradient chunk on the device (end of backward)."""
        for copy in self.device:
            if copy.key[0] is Kind.GRAD:
                self.device.evict(copy.key)

    def drop_param(self, i: int) -> None:
        """Forget cached copies of parameter chunk ``i`` (its home was updated)."""
        key = (Kind.PARAM, i)
        if key in self.device:
            self.device.remove(key)

    def _write_back_device(self, copy: Copy) -> None:
        kind, i = copy.key
        if kind is not Kind.GRAD:
            raise AssertionError(f"device copy {copy.key} is dirty but only gradients flow back")
        grads = typed(copy.tensor, self.dtype)
        if self.check_overflow and not bool(torch.isfinite(grads).all()):
            self.found_inf = True
        key: Key = (Kind.GRAD, i)
        nbytes = self.nbytes(key)
        self.traffic.d2h_bytes += nbytes
        if self.homes.tier(key) == HOST and not self.grad_valid[i]:
            handle = self.backend.copy_async(self.homes.host(key), copy.tensor)
            with self.traffic.waiting("device"):
                handle.wait()
            self.grad_valid[i] = True
            return
        stage_key = ("incoming", i)
        cache = self.staging[Kind.GRAD]
        stage = cache.insert(stage_key, nbytes, self.moment)
        try:
            handle = self.backend.copy_async(stage.tensor, copy.tensor)
            with self.traffic.waiting("device"):
                handle.wait()
            if self.homes.tier(key) == HOST:
                home = typed(self.homes.host(key), self.dtype)
                home.add_(typed(stage.tensor, self.dtype))
                self._check_sum(home)
            else:
                if self.grad_valid[i]:
                    old = self._staged(key, load=True)
                    total = typed(old.tensor, self.dtype)
                    total.add_(typed(stage.tensor, self.dtype))
                    self._check_sum(total)
                    out = old
                else:
                    out = stage
                with self.traffic.waiting("nvme"):
                    self.homes.write(key, out.tensor).wait()
                if out is not stage:
                    cache.remove(key)
            self.grad_valid[i] = True
        finally:
            cache.remove(stage_key)

    def _check_sum(self, grads: torch.Tensor) -> None:
        # NOTE: adding two finite fp16 gradients can overflow, so accumulated
        # sums are checked too, not only what came off the device.
        if self.check_overflow and not bool(torch.isfinite(grads).all()):
            self.found_inf = True

    def _write_back_staged(self, copy: Copy) -> None:
        key = copy.key
        with self.traffic.waiting("nvme"):
            self.homes.write(key, copy.tensor).wait()

    # --- host side: optimizer and state access ----------------------------------
    def open_host(self, key: Key, *, load: bool = True) -> tuple[torch.Tensor, Copy | None]:
        """Host bytes of ``key`` for reading or updating; pair with :meth:`close_host`."""
        if self.homes.tier(key) == HOST:
            return self.homes.host(key), None
        copy = self._staged(key, load=load)
        copy.pins += 1
        return copy.tensor, copy

    def close_host(self, copy: Copy | None, *, modified: bool, keep: bool = False) -> None:
        """Finish with a host copy from :meth:`open_host`: write it home if modified."""
        if copy is None:
            return
        copy.pins -= 1
        cache = self.staging[copy.key[0]]
        if modified:
            request = self.homes.write(copy.key, copy.tensor)
            copy.pending.append(request)
        if not keep:
            cache.remove(copy.key)

    def write_initial(self, i: int, values: torch.Tensor) -> None:
        """Set chunk ``i``'s parameters (and fp32 master, zero moments) from fp32 ``values``."""
        region, copy = self.open_host((Kind.PARAM, i), load=False)
        typed(region, self.dtype).copy_(values)
        self.close_host(copy, modified=True)
        if self.plan.grad_home[i] is None:
            return
        region, copy = self.open_host((Kind.OPTIM, i), load=False)
        state = typed(region, torch.float32)
        state.zero_()
        if self.plan.has_master:
            state[: values.numel()].copy_(values)
        self.close_host(copy, modified=True)

    def invalidate_grads(self) -> None:
        """Gradients were zeroed: the next flush overwrites instead of adding."""
        self.grad_valid = [False] * len(self.grad_valid)
        self.found_inf = False

    def synchronize(self) -> None:
        """Wait for every transfer in flight in every tier."""
        for cache in (self.device, *self.staging.values()):
            for copy in cache:
                copy.wait()
        self.backend.synchronize()

    def advance(self) -> int:
        """Move to the next moment of the step; returns it."""
        self.moment += 1
        return self.moment

    def resident(self, key: Hashable) -> bool:
        """``key`` has a copy on the device."""
        return key in self.device
