"""The install is pinned and the repository is self-contained: what a fresh clone on another machine needs."""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# docker/ names container paths
SOURCES = [
    p
    for folder in ("augtree_verl", "tests", "benchmarks", "examples", "recipes", ".ci")
    for p in (REPO / folder).rglob("*")
    if p.is_file()
    and p.suffix in {".py", ".sh", ".yaml", ".toml", ""}
    and "data" not in p.relative_to(REPO).parts
    and "__pycache__" not in p.parts
    and p != Path(__file__).resolve()
]


# lock -> the extras it installs beside the dependencies (.ci/locks.py says how each lock is made)
LOCKS = {"constraints.txt": ("test",), "constraints-gpu.txt": ("gpu", "test")}


def _pins(lock: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / lock).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"{lock}: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = pinned
    return pins


def _requirements(extras) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return [Requirement(r) for r in reqs]


def test_every_requirement_is_pinned_in_both_locks():
    for lock, extras in LOCKS.items():
        pins = _pins(lock)
        for req in _requirements(extras):
            name = canonicalize_name(req.name)
            assert name in pins, f"{req.name} (pyproject.toml) has no pin in {lock}: run bash .ci/lock"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{req.name}: {lock} pins {pins[name]}, violating {req}"
            )


def test_the_gpu_lock_is_verls_gpu_stack():
    pins = _pins("constraints-gpu.txt")
    verl_stack = {"torch": "2.11.0", "vllm": "0.24.0", "transformers": "5.9.0", "verl": "0.9.1"}
    assert {n: pins.get(n) for n in verl_stack} == verl_stack


def test_installed_at_the_pins_of_one_lock():
    """The environment is one lock's install (CI's main lane: constraints.txt; its GPU-stack lane:
    constraints-gpu.txt), told apart by the installed torch."""
    torch_version = version("torch").split("+")[0]
    lock = next((name for name in LOCKS if _pins(name)["torch"] == torch_version), None)
    assert lock, f"torch {torch_version} is installed, neither lock pins it"
    for name, pinned in _pins(lock).items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        assert installed.split("+")[0] == pinned, f"{name} {installed} installed, {lock} pins {pinned}"


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
