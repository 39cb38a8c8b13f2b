"""``TIDAL_KERNELS``: which operations the dispatchers send to their torch references."""

from __future__ import annotations

import ast
import pathlib

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
    ("torch:", False, set()),
])
def test_forced_names_parse(monkeypatch, value, every, names):
    monkeypatch.setenv("TIDAL_KERNELS", value)
    assert backend._forced_to_torch() == (every, frozenset(names))


@pytest.mark.parametrize("value, match", [
    ("torch:route,flash", r"\['flash'\].*known: attention, conv"),
    ("route", "expected 'triton', 'torch' or 'torch:NAME"),
    ("torch route", "expected"),
    ("torch;moe", "expected"),
])
def test_bad_values_are_errors(monkeypatch, value, match):
    monkeypatch.setenv("TIDAL_KERNELS", value)
    with pytest.raises(ValueError, match=match):
        backend.forces_torch()


def _dispatches() -> list[tuple[str, ast.Call]]:
    calls = []
    for folder in ("kernels", "executor"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "backend.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) \
                        == "use_triton":
                    calls.append((f"{path.name}:{node.lineno}", node))
    return calls


def test_every_dispatch_names_a_known_operation():
    """Each ``use_triton`` call in the kernels and the executor names an operation ``TIDAL_KERNELS`` can
    force, so bisecting by name reaches every kernel, and every name is used."""
    calls = _dispatches()
    assert len(calls) >= 20
    used = set()
    for where, call in calls:
        assert len(call.args) == 2 and isinstance(call.args[1], ast.Constant), where
        assert call.args[1].value in backend.KERNELS, where
        used.add(call.args[1].value)
    assert used == set(backend.KERNELS)


def test_cpu_tensors_take_the_reference_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    assert not backend.use_triton(torch.zeros(1), "route")


@pytest.mark.parametrize("value, forced", [("", False), ("triton", False), ("torch", True), ("torch:route", True),
                                           ("torch:", False)])
def test_forces_torch(monkeypatch, value, forced):
    """What ``build_runner`` asks before it captures decode graphs."""
    monkeypatch.setenv("TIDAL_KERNELS", value)
    assert backend.forces_torch() is forced


@pytest.mark.parametrize("value, kw, want", [
    ("", {}, True),
    ("torch", {}, False),
    ("torch:route", {}, False),
    ("", {"disable_cuda_graph": True}, False),
    ("", {"ple_backend": "pinned"}, True),  # the device reads a decode step's rows from the pinned table
    ("", {"ple_backend": "disk"}, False),
])
def test_decode_graphs_decision(monkeypatch, value, kw, want):
    """``build_runner`` captures decode graphs on CUDA only while no operation is forced onto a torch
    reference (and with graphs enabled, a PLE table on the device or pinned, one rank)."""
    from tidal.config.server_args import ServerArgs
    from tidal.executor.runner import decode_graphs

    monkeypatch.setenv("TIDAL_KERNELS", value)
    args = ServerArgs(**kw)
    assert decode_graphs(args, "cuda", offloaded=False, ranks=1) is want
    assert decode_graphs(args, "cpu", offloaded=False, ranks=1) is False
    assert decode_graphs(args, "cuda", offloaded=True, ranks=1) is False
    assert decode_graphs(args, "cuda", offloaded=False, ranks=2) is False
