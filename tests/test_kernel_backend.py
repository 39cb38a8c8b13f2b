"""``TIDAL_KERNELS``: which operations the dispatchers send to their torch references."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from tidal.kernels import backend

ROOT = pathlib.Path(backend.__file__).resolve().parents[1]


@pytest.mark.parametrize("value, every, names", [
    ("", False, set()),
    ("triton", False, set()),
    ("torch", True, set()),
    (" Torch ", True, set()),
    ("torch:route,qsa_select", False, {"route", "qsa_select"}),
    ("torch: moe_gemv , ", False, {"moe_gemv"}),
])
def test_forced_names_parse(monkeypatch, value, every, names):
    monkeypatch.setenv("TIDAL_KERNELS", value)
    assert backend._forced_to_torch() == (every, frozenset(names))


def test_unknown_name_is_an_error_listing_the_known_ones(monkeypatch):
    monkeypatch.setenv("TIDAL_KERNELS", "torch:route,flash")
    with pytest.raises(ValueError, match=r"\['flash'\].*known: attention, conv"):
        backend.forces_torch()


def test_every_dispatch_names_a_known_operation():
    """Each ``use_triton`` call in the package names an operation ``TIDAL_KERNELS`` can force, so
    bisecting by name reaches every kernel."""
    calls = []
    for path in ROOT.rglob("*.py"):
        if "tests" in path.parts or path.name == "backend.py":
            continue
        for m in re.finditer(r"use_triton\(([^()]*)\)", path.read_text()):
            calls.append((path.name, m.group(1)))
    assert len(calls) >= 20
    for name, args in calls:
        parts = [a.strip() for a in args.split(",")]
        assert len(parts) == 2, (name, args)
        assert parts[1].strip('"') in backend.KERNELS, (name, args)
    used = {a.split(",")[1].strip().strip('"') for _, a in calls}
    assert used == set(backend.KERNELS)


def test_cpu_tensors_take_the_reference_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    assert not backend.use_triton(torch.zeros(1), "route")


@pytest.mark.parametrize("value, forced", [("", False), ("triton", False), ("torch", True), ("torch:route", True),
                                           ("torch:", False)])
def test_forces_torch(monkeypatch, value, forced):
    """Any forced operation keeps the decode graphs off (``build_runner``)."""
    monkeypatch.setenv("TIDAL_KERNELS", value)
    assert backend.forces_torch() is forced
