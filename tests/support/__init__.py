"""Helpers shared by the tests: tiny models, Serve and tensor-parallel fixtures, Triton interpreter cases."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
