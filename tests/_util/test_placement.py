"""`Placement`: the device a backend's collectives use, and where receivers allocate."""

from __future__ import annotations

import torch

from elastic._util.placement import Placement


def test_gloo_communicates_from_the_cpu() -> None:
    placement = Placement.for_backend("gloo")
    assert placement.device == torch.device("cpu")
    t = torch.zeros(3)
    assert placement.carries(t) and placement.stage(t) is t


def test_receivers_allocate_on_the_source_device_type_where_they_can() -> None:
    cpu = Placement(torch.device("cpu"))
    assert cpu.allocate_on("cpu") == torch.device("cpu")
    assert cpu.allocate_on("meta") == torch.device("cpu")  # another type: the CPU
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    assert cpu.allocate_on("cuda") == torch.device(expected)
    meta = Placement(torch.device("meta"))
    assert meta.allocate_on("meta") == torch.device("meta")  # the collectives' own type
    assert not meta.carries(torch.zeros(1))
    assert meta.stage(torch.zeros(2)).device == torch.device("meta")
