"""Where the repository's files are, for test modules at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DATA = TESTS / "data"  # files the suite ships (the conversion's golden record)
DRIVERS = TESTS / "support" / "drivers"  # scripts the multi-rank tests launch with `composer -n 2`
RECIPES = REPO / "recipes"
