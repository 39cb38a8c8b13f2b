"""``tidal run ROLE``: one mesh process on its own (placeholder until written)."""

from __future__ import annotations

import argparse


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=["frontend", "scheduler", "executor", "detokenizer"])


def run_role(ns: argparse.Namespace) -> int:
    raise NotImplementedError("tidal run")
