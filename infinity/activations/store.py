"""``activations="offload"``: saved tensors leave the device, read back ahead of backward.

The engine's saved-tensor pack hook hands every tensor autograd saves during a
forward to :meth:`ActivationStore.pack`. One of at least ``min_bytes`` on the
compute device becomes a :class:`SavedActivation` (what autograd then holds):

- it goes to **host memory** first (on the CPU backend, where host and device
  memory are the same RAM, it stays where it is and only its accounting moves);
- when the host share is full, the **oldest** host-resident tensor is written
  to NVMe (:mod:`.spill`): backward needs the newest first, so the newest stay
  in memory and the disk gets the most time to bring the oldest back;
- the newest tensors written stay in memory too, in their written buffers (at
  most ``read_ahead`` bytes): when the forward ends they are the ones backward
  needs first, and no read has had time to bring them back;
- backward unpacks in about the reverse order of packing: each unpack starts
  reads of the next tensors below it in that order (at most ``read_ahead``
  bytes ahead), so it waits only when the disk is slower than the compute.

Host memory held is therefore three named lines, each within its limit: the host
share (``host_capacity``), the read window (``read_ahead`` bytes of written-and-kept
or read-ahead buffers) and the write window (``write_window`` bytes of writes in
flight). :func:`split_allowance` divides the host memory the budget leaves
activations into the three, so that together they stay inside ``host_memory``: the
windows shrink with it, and ``stats()["activations"]`` says how large they are and
the peak of each line and of their sum. A tensor larger than the write window is
written through half of it, a piece at a time (each waited for; the buffer is kept
and counted in the window from then on); one larger than the
read window is read when backward needs it, into the buffer that becomes the
tensor backward uses (the step's working set, as under ``"keep"``; reported as
``read_on_demand_peak_bytes``).

A failed write or read raises :class:`~infinity.io.NVMeIOError` from the next
pack or unpack: the step fails, it never computes with wrong data.
"""

from __future__ import annotations

import bisect
import threading
import time
import warnings
from collections import deque
from typing import Any

import torch

from infinity.activations.spill import (
    ALIGN,
    ActivationSpill,
    SavedActivation,
    _flat,
    _Record,
    _restore,
)
from infinity.io import aligned_empty
from infinity.utils.sizes import align_up, format_size

HOST, NVME = "host", "nvme"
READ_AHEAD = 256 << 20  # the read window at most: buffers of NVMe tensors before their use
WRITE_WINDOW = 64 << 20  # the write window at most: writes in flight before a pack waits


def split_allowance(allowance: int, spill: bool) -> tuple[int, int, int]:
    """The host share, read window and write window of ``allowance`` bytes of host
    memory for saved activations (no windows without an NVMe tier to spill to).

    The windows take at most a quarter and an eighth of the allowance, so that a
    small budget shrinks them rather than being exceeded; the host share is the rest.
    The write window holds at least two I/O blocks where the allowance has them: its
    piece buffer is half of it and at least one block (the sweep's host-line check
    found a 3,353-byte window under a 4,096-byte piece).
    """
    if not spill:
        return allowance, 0, 0
    write = min(WRITE_WINDOW, max(allowance // 8, 2 * ALIGN), allowance)
    read = min(READ_AHEAD, allowance // 4, allowance - write)
    return allowance - read - write, read, write


class ActivationStore:
    """Saved tensors of the forward passes in flight, in host memory and on NVMe.

    Args:
        device: the compute device (tensors elsewhere stay put).
        shares_host_memory: the device's memory is host RAM (the CPU backend).
        host_capacity: bytes of host memory activations may hold.
        min_bytes: smaller tensors stay on the device.
        spill: NVMe space beyond host memory, or ``None`` (no NVMe tier: a
            tensor that does not fit in host memory stays on the device).
        read_ahead: bytes of buffers holding NVMe-resident tensors in memory: the
            newest written (forward) and the reads started ahead (backward).
        write_window: bytes of writes in flight before a pack waits for the oldest.
        warn_when_full: warn once when a tensor stays on the device for want of
            room (not under ``"auto"``, whose measuring first step expects it).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        shares_host_memory: bool,
        host_capacity: int,
        min_bytes: int,
        spill: ActivationSpill | None,
        read_ahead: int = READ_AHEAD,
        write_window: int = WRITE_WINDOW,
        warn_when_full: bool = True,
    ) -> None:
        self.device = device
        self.shares_host_memory = shares_host_memory
        self.host_capacity = host_capacity
        self.min_bytes = min_bytes
        self.spill = spill
        self.read_ahead = read_ahead
        self.write_window = write_window
        self._pieces: torch.Tensor | None = None  # half the write window, once needed
        self.warn_when_full = warn_when_full
        self._lock = threading.RLock()
        self._seq = 0
        self._host: deque[_Record] = deque()  # host-resident, oldest first
        self._nvme: list[_Record] = []  # on NVMe, by seq
        # Writes in flight, oldest first (a dropped record's extent is freed once written).
        self._writes: deque[_Record] = deque()
        self._write_bytes = 0
        self._read_bytes = 0  # buffers holding NVMe-resident tensors, not yet unpacked
        self._kept: deque[_Record] = deque()  # written in this forward, buffer kept, oldest first
        self._backward = False  # between a forward's end and the next pack
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "packed", "packed_bytes", "kept_small", "kept_on_device_bytes",
                "host_bytes", "host_peak_bytes", "nvme_bytes", "nvme_peak_bytes",
                "nvme_written_bytes", "nvme_read_bytes", "written_kept_bytes", "reads_ahead",
                "reads_waited",
                "reads_not_ahead", "read_wait_seconds", "read_peak_bytes", "write_peak_bytes",
                "held_peak_bytes", "read_on_demand_peak_bytes", "written_in_pieces",
            ),
            0,
        )  # fmt: skip

    def set_allowance(self, allowance: int) -> None:
        """Divide ``allowance`` bytes of host memory into the three lines
        (:func:`split_allowance`); counts from now on."""
        with self._lock:
            self.host_capacity, self.read_ahead, self.write_window = split_allowance(
                allowance, self.spill is not None
            )

    @property
    def allowance(self) -> int:
        """Host bytes of the three lines together."""
        return self.host_capacity + self.read_ahead + self.write_window

    def _mark(self) -> None:
        """Record the peaks of the windows and of everything held in host memory."""
        c = self.counters
        c["read_peak_bytes"] = max(c["read_peak_bytes"], self._read_bytes)
        c["write_peak_bytes"] = max(c["write_peak_bytes"], self._write_bytes)
        held = c["host_bytes"] + self._read_bytes + self._write_bytes
        c["held_peak_bytes"] = max(c["held_peak_bytes"], held)

    # --- pack (forward) ------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """Keep ``tensor`` (small, or not on the device) or move it; returns what autograd holds."""
        if (
            tensor.device != self.device
            or tensor.layout != torch.strided
            or tensor.numel() == 0
            or tensor.numel() * tensor.element_size() < self.min_bytes
        ):
            self.counters["kept_small"] += 1
            return tensor
        with self._lock:
            self._backward = False
            self._reap_writes(block=False)
            saved = _Record(self._seq + 1, tensor)
            nbytes = saved.nbytes
            if self.spill is not None and nbytes <= self.host_capacity:
                while self._host and self._host_bytes() + nbytes > self.host_capacity:
                    self._evict(self._host.popleft())
            fits = nbytes <= self.host_capacity - self._host_bytes()
            if not fits and self.spill is None:  # no NVMe tier: it stays where it is
                self._warn_full(nbytes)
                self.counters["kept_on_device_bytes"] += nbytes
                return tensor
            self._seq += 1
            self.counters["packed"] += 1
            self.counters["packed_bytes"] += nbytes
            if fits:
                saved.host = self._to_host(saved, tensor)
                self._host.append(saved)
                self._count(HOST, nbytes)
            else:  # larger than the whole host share: straight to NVMe
                self._write(saved, _flat(saved, tensor))
            return SavedActivation(self, saved)

    def _warn_full(self, nbytes: int) -> None:
        if self.warn_when_full and self.counters["kept_on_device_bytes"] == 0:
            warnings.warn(
                f"activations='offload': a saved tensor of {format_size(nbytes)} does not fit "
                f"in the {format_size(self.host_capacity)} of host memory the states leave "
                "free, and there is no NVMe tier: it stays on the device (stats()"
                "['activations']['kept_on_device_bytes'] counts them); raise host_memory or "
                "set nvme_path",
                RuntimeWarning,
                stacklevel=3,
            )

    def _to_host(self, saved: _Record, tensor: torch.Tensor) -> torch.Tensor:
        """What the host tier keeps: on the CPU backend the tensor itself (same RAM: a
        copy would only cost time), else its bytes in pinned memory."""
        if self.shares_host_memory:
            return tensor.detach()
        flat = _flat(saved, tensor)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return host.copy_(flat)  # synchronous: correct without events

    def _evict(self, saved: _Record) -> None:
        """Write a host-resident tensor to NVMe and let its memory go."""
        host = saved.host
        assert host is not None
        saved.host = None
        self._count(HOST, -saved.nbytes)
        self._write(saved, _flat(saved, host) if self.shares_host_memory else host)

    def _write(self, saved: _Record, data: torch.Tensor) -> None:
        assert self.spill is not None
        need = align_up(saved.nbytes, ALIGN)
        saved.file, saved.offset = self.spill.allocate(saved.nbytes)
        if self._write_bytes_room() < need:
            self._write_in_pieces(saved, data.view(torch.uint8))
            return
        # NOTE: room first, then the buffer: the window holds what is in flight, beside
        # the piece buffer (allocated or not, its half is never lent to these).
        pieces = 0 if self._pieces is None else self._pieces.numel()
        room = self._write_bytes_room()
        while self._writes and self._write_bytes - pieces + need > room:
            self._finish_write(self._writes.popleft())
        buffer = aligned_empty(need, pinned=False)
        buffer[: saved.nbytes].copy_(data.view(torch.uint8))
        saved.write = (saved.file.write(buffer, saved.offset), buffer)
        self._writes.append(saved)
        self._write_bytes += buffer.numel()
        bisect.insort(self._nvme, saved, key=lambda s: s.seq)
        self._count(NVME, saved.nbytes)
        self.counters["nvme_written_bytes"] += saved.nbytes
        self._mark()

    def _piece_bytes(self) -> int:
        """Half the write window (at least one I/O block): the piece buffer's size."""
        return max(ALIGN, self.write_window // 2 // ALIGN * ALIGN)

    def _write_bytes_room(self) -> int:
        """The most a whole-tensor write may take: the window less the piece buffer."""
        return self.write_window - self._piece_bytes()

    def _write_in_pieces(self, saved: _Record, data: torch.Tensor) -> None:
        """Write a tensor too large for the write window's room through the piece
        buffer, a piece at a time, each waited for before the next is copied.

        NOTE: one buffer, kept: the I/O engine holds a finished request (and its
        buffer) until its next submission, so a buffer per tensor could briefly
        exist twice. It is counted in the write line from its first use."""
        assert saved.file is not None and self.spill is not None
        piece = self._piece_bytes()
        if self._pieces is None or self._pieces.numel() != piece:
            self._write_bytes -= 0 if self._pieces is None else self._pieces.numel()
            self._pieces = aligned_empty(piece, pinned=False)
            self._write_bytes += piece
            self._mark()
        buffer = self._pieces
        try:
            for start in range(0, saved.nbytes, piece):
                n = min(piece, saved.nbytes - start)
                buffer[:n].copy_(data[start : start + n])
                saved.file.write(buffer[: align_up(n, ALIGN)], saved.offset + start).wait()
        except BaseException as exc:
            # NOTE: no record holds the extent: a pack fails, an eviction's tensor raises
            # this when backward asks for it (_forget must not release it again)
            self.spill.release()
            saved.failed = exc
            raise
        bisect.insort(self._nvme, saved, key=lambda s: s.seq)
        self._count(NVME, saved.nbytes)
        self.counters["nvme_written_bytes"] += saved.nbytes
        self.counters["written_in_pieces"] += 1

    def _reap_writes(self, block: bool) -> None:
        while self._writes:
            write = self._writes[0].write
            if not (block or write is None or write[0].done()):
                return
            self._finish_write(self._writes.popleft())

    def _finish_write(self, saved: _Record) -> None:
        if saved.write is None:
            return
        request, buffer = saved.write
        saved.write = None
        self._write_bytes -= buffer.numel()
        fits = self._read_bytes + buffer.numel() <= self.read_ahead
        if not saved.used and not saved.dropped and (fits or not self._backward):
            # The written bytes serve as the tensor's read (the request is done:
            # unpack's wait returns at once, or raises). In forward the newest are kept
            # and the oldest let go (_trim_kept): backward starts with them. In backward
            # only within the read window: the write window has room for new writes
            # again (a recomputed block packs), so past it the two could exceed the
            # budget together.
            saved.read = (request, buffer)
            saved.kept = True
            self._read_bytes += buffer.numel()
            if not self._backward:
                self._kept.append(saved)
                self._trim_kept()
            self._mark()  # NOTE: after the trim: the buffer only moved from the write line
        try:
            request.wait()  # raises NVMeIOError
        except BaseException as exc:
            saved.failed = exc  # its bytes on disk are not its values: unpack raises too
            raise
        finally:
            if saved.dropped:
                self._forget(saved)

    def _trim_kept(self) -> None:
        """Let the oldest kept buffers go while they exceed the window (forward only)."""
        while self._kept:
            oldest = self._kept[0]
            if oldest.read is not None and not oldest.used:
                if self._read_bytes <= self.read_ahead:
                    return
                self._read_bytes -= oldest.read[1].numel()
                oldest.read, oldest.kept = None, False
            self._kept.popleft()

    # --- unpack (backward) ---------------------------------------------------------------
    def unpack(self, handle: SavedActivation) -> torch.Tensor:
        """The saved tensor's values on the device; starts reads of the ones needed next."""
        saved = handle.record
        with self._lock:
            self._backward = True
            self._reap_writes(block=False)  # before `used`: a landed write serves it
            saved.used = True
            if saved.file is None:  # in host memory
                assert saved.host is not None
                out = (
                    saved.host
                    if self.shares_host_memory
                    else _restore(saved, saved.host.to(self.device))
                )
            else:
                out = self._from_nvme(saved)
            self._read_ahead()
            return out

    def _from_nvme(self, saved: _Record) -> torch.Tensor:
        if saved.failed is not None:
            raise saved.failed
        if saved.write is not None:  # still being written: its buffer holds the bytes
            buffer = saved.write[1]
            self.counters["written_kept_bytes"] += saved.nbytes
        else:
            if saved.read is None:
                # Read on demand, into the buffer that becomes the tensor backward
                # uses now: the step's working set (as the tensor is under "keep"), not
                # a line of the store; stats report its largest.
                self.counters["reads_not_ahead"] += 1
                request, buffer = self._read(saved)
                peak = "read_on_demand_peak_bytes"
                self.counters[peak] = max(self.counters[peak], buffer.numel())
            else:
                request, buffer = saved.read
                saved.read = None
                self._read_bytes -= buffer.numel()
            if saved.kept:
                self.counters["written_kept_bytes"] += saved.nbytes
            if not request.done():
                self.counters["reads_waited"] += 1
                start = time.perf_counter()
                request.wait()
                self.counters["read_wait_seconds"] += time.perf_counter() - start
            else:
                request.wait()  # raises NVMeIOError
        flat = buffer[: saved.nbytes].view(saved.dtype)
        return _restore(saved, flat if self.shares_host_memory else flat.to(self.device))

    def _read(self, saved: _Record) -> tuple[Any, torch.Tensor]:
        """Start reading ``saved`` back from NVMe: the request and its buffer."""
        assert saved.file is not None
        buffer = aligned_empty(align_up(saved.nbytes, ALIGN), pinned=False)
        self.counters["nvme_read_bytes"] += saved.nbytes
        return saved.file.read(buffer, saved.offset), buffer

    def _start_read(self, saved: _Record) -> None:
        """Read ``saved`` ahead of its use, into the read window."""
        saved.read = self._read(saved)
        self._read_bytes += saved.read[1].numel()
        self._mark()

    def end_forward(self) -> None:
        """A forward ended: start reading the newest tensors on NVMe, which backward
        needs first (usually there are none: the newest stay in host memory)."""
        with self._lock:
            self._backward = True
            try:
                self._read_ahead()
            except Exception:
                # NOTE: best effort: this runs from the forward's last hook, also while
                # an exception unwinds, which it must not replace. A read that did not
                # start is started again by its unpack, which raises if it fails.
                pass

    def _read_ahead(self) -> None:
        """Start reads of the NVMe-resident tensors backward has not used yet, newest
        first (backward runs about in reverse order of packing), up to ``read_ahead``
        bytes. NOTE: not only those below the last one used: autograd's order is
        not strictly the reverse, and a newer tensor still unused is needed soonest."""
        for saved in reversed(list(self._nvme)):
            size = align_up(saved.nbytes, ALIGN)
            if size > self.read_ahead:
                continue  # never fits: read on demand when backward unpacks it
            if self._read_bytes + size > self.read_ahead:
                return  # the newest first: this one waits for room
            if saved.read is None and saved.write is None and not saved.used:
                self.counters["reads_ahead"] += 1
                self._start_read(saved)

    # --- lifetime ------------------------------------------------------------------------
    def drop(self, saved: _Record) -> None:
        """Autograd released ``saved`` (used by backward, or its graph freed)."""
        with self._lock:
            if saved.dropped:
                return
            saved.dropped = True
            if saved.file is None:  # in host memory (host None: being evicted)
                # host None: being evicted (a collection ran inside pack): its write
                # finishes the drop (_finish_write)
                if saved.host is not None:
                    saved.host = None
                    self._host.remove(saved)
                    self._count(HOST, -saved.nbytes)
                return
            self._forget(saved)

    def _forget(self, saved: _Record) -> None:
        """Free a dropped record's NVMe extent, unless the disk still writes it (then
        :meth:`_finish_write` calls this again; no wait on autograd's thread)."""
        if saved.write is not None or (saved.failed is not None and saved not in self._nvme):
            return
        self._nvme.remove(saved)
        self._count(NVME, -saved.nbytes)
        if saved.read is not None:
            self._read_bytes -= saved.read[1].numel()
            saved.read = None  # NOTE: the I/O engine keeps an unfinished request alive
        assert self.spill is not None
        self.spill.release()

    def _host_bytes(self) -> int:
        return int(self.counters["host_bytes"])

    def _count(self, tier: str, delta: int) -> None:
        now = self.counters[f"{tier}_bytes"] + delta
        self.counters[f"{tier}_bytes"] = now
        peak = f"{tier}_peak_bytes"
        self.counters[peak] = max(self.counters[peak], now)
        self._mark()

    def tier_bytes(self) -> tuple[int, int]:
        """Bytes held now in host memory and on NVMe (for the memory timeline)."""
        return int(self.counters["host_bytes"]), int(self.counters["nvme_bytes"])

    def snapshot(self) -> dict[str, float]:
        """Counters: totals since offload, bytes per tier now and at their peak, the
        lines of host memory (host share, read and write windows) and their peaks."""
        with self._lock:
            return {
                **self.counters,
                "host_share_bytes": self.host_capacity,
                "read_window_bytes": self.read_ahead,
                "write_window_bytes": self.write_window,
            }

    def close(self) -> None:
        """Finish the writes in flight and remove the swap files."""
        with self._lock:
            try:
                self._reap_writes(block=True)
            finally:
                if self.spill is not None:
                    self.spill.close()
