"""The ``packattn`` command: ``info`` and ``bench``."""

from __future__ import annotations

import argparse
import platform

import torch

from .dispatch import info


def _info() -> int:
    print(f"packattn on torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} threads")
    width = max(len(b.name) for b in info())
    for b in info():
        state = "available" if b.available else f"unavailable: {b.reason}"
        print(f"  {b.name:<{width}}  {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="packattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="list backends and why any cannot run here")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    return 2
