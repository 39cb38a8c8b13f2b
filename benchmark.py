"""``tidal bench``: placeholder until written."""

from __future__ import annotations

import argparse


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True)


def run_bench(ns: argparse.Namespace) -> int:
    raise NotImplementedError("tidal bench")
