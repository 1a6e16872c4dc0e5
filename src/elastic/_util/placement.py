"""Where bytes and tensors live for a backend: the one place that knows about CUDA and NCCL.

A backend's collectives run on one device: the current CUDA device for NCCL, the CPU for every other
backend. That device holds the object payloads (as uint8 tensors), the transport's buckets and the
temporaries through which a tensor on another device is staged. A tensor a receiver lacks is allocated on
the device type it has at the source where this process has one (CUDA when available), else on the
collectives' device when the types match, else on the CPU.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["Placement"]


@attrs.frozen
class Placement:
    """The device a group's collectives use, and the rules that follow from it."""

    device: torch.device

    @classmethod
    def for_backend(cls, backend: str) -> Placement:
        """NCCL communicates from the current CUDA device; every other backend from the CPU."""
        if backend == "nccl":
            return cls(torch.device("cuda", torch.cuda.current_device()))
        return cls(torch.device("cpu"))

    def carries(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` can take part in a collective as it is (it lives on the collectives' device)."""
        return tensor.device == self.device

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the collectives' device (itself when already there)."""
        return tensor.to(self.device)

    def allocate_on(self, device_type: str) -> torch.device:
        """Where a receiver allocates a tensor that lives on `device_type` at the source."""
        if device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if device_type == self.device.type:
            return self.device
        return torch.device("cpu")
