"""Device backends: allocate device slots, copy host<->device asynchronously, wait.

The CPU backend (hosts without a GPU, and every test here) runs the same
asynchrony as CUDA: the "device" is a separately budgeted pool in RAM and
copies run on a copy thread, so a missing wait shows up as a wrong result.
"""

from infinity.devices.base import DeviceBackend, TransferHandle
from infinity.devices.choice import make_backend

__all__ = ["DeviceBackend", "TransferHandle", "make_backend"]
