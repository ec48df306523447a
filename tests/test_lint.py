"""The package, tests and benchmarks pass ruff (lint, with the rules in pyproject.toml's [tool.ruff], and format:
``ruff format augtree_verl tests benchmarks`` leaves them unchanged) and the package passes mypy ([tool.mypy]).
Each check is skipped, saying why, only when its tool is not installed (``pip install -e '.[test]'`` installs
them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "pyproject.toml")


def _tool(name: str) -> list[str]:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (it is in the test extra: pip install -e '.[test]')")
    return [sys.executable, "-m", name]


def _run(command: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _ruff(*paths: str) -> subprocess.CompletedProcess:
    return _run([*_tool("ruff"), "check", "--config", CONFIG, "--no-cache", *paths], timeout=120)


def _ruff_format_check(*paths: str) -> subprocess.CompletedProcess:
    return _run([*_tool("ruff"), "format", "--check", "--config", CONFIG, "--no-cache", *paths], timeout=120)


def _mypy(*paths: str) -> subprocess.CompletedProcess:
    return _run([*_tool("mypy"), "--config-file", CONFIG, *paths], timeout=600)


def test_ruff_finds_nothing():
    done = _ruff("augtree_verl", "tests", "benchmarks")
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, f"ruff check augtree_verl tests benchmarks:\n{report}"


def test_ruff_format_changes_nothing():
    done = _ruff_format_check("augtree_verl", "tests", "benchmarks")
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, f"ruff format --check augtree_verl tests benchmarks (run without --check):\n{report}"


@pytest.mark.timeout(600)
def test_mypy_finds_nothing():
    done = _mypy("augtree_verl")
    assert done.returncode == 0, f"mypy augtree_verl:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"


# The checks above fail on a finding: the same commands, with the same configuration, on planted ones.


def test_ruff_reports_a_planted_finding(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x=[]):\n    return x\n")  # F401 unused import, B006 mutable default
    done = _ruff(str(bad))
    assert done.returncode != 0 and "F401" in done.stdout and "B006" in done.stdout, done.stdout


def test_ruff_format_reports_a_planted_finding(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = {  'a':1 }\n")
    done = _ruff_format_check(str(bad))
    assert done.returncode != 0 and "bad.py" in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.timeout(600)
def test_mypy_reports_a_planted_finding(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(n: int) -> str:\n    return n\n")
    done = _mypy(str(bad))
    assert done.returncode != 0 and "Incompatible return value type" in done.stdout, done.stdout
