"""The install is pinned and the repository is self-contained: what a fresh clone on another machine needs."""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# docker/ names container paths
SOURCES = [p for folder in ("augtree_verl", "tests", "benchmarks", "examples", "recipes", ".ci")
           for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in {".py", ".sh", ".yaml", ".toml", ""}
           and "data" not in p.relative_to(REPO).parts and "__pycache__" not in p.parts
           and p != Path(__file__).resolve()]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = pinned
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_every_requirement_is_pinned_and_installed_at_its_pin():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in constraints.txt: run bash .ci/lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}: pin {pins[name]} violates {req}"
    for name, pinned in pins.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        assert installed.split("+")[0] == pinned, f"{name} {installed} installed, constraints.txt pins {pinned}"


def test_no_file_names_a_path_of_the_development_machine():
    pattern = re.compile(r"(^|[^.\w])/(work|root|home)/\w")
    offenders = [str(p.relative_to(REPO)) for p in SOURCES if pattern.search(p.read_text(errors="ignore"))]
    assert not offenders, f"absolute paths of one machine in {offenders}"


def test_documents_referred_to_are_in_the_repository():
    outside = re.compile(r"DESIGN\.md|VERL_ON_CPU\.md|SCALE\.md|E2E\.md|shared/docs|\.\./shared")
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "examples").rglob("*.md")]
    offenders = [str(p.relative_to(REPO)) for p in SOURCES + docs if outside.search(p.read_text(errors="ignore"))]
    assert not offenders, f"references to documents outside the repository in {offenders}"
    assert (REPO / "docs" / "design.md").is_file()
