"""The two locks: what each resolves, how it is written, and the check that it is current.

    constraints.txt      CPU (what CI runs): torch 2.13.0's CPU build, transformers 5.10.4, the test extra.
    constraints-gpu.txt  GPU (verl 0.9.1's `vllm` extra: torch 2.11.0, vLLM 0.24.0, transformers 5.9.0),
                         the gpu and test extras.

Both are made from a resolution report (`pip install --dry-run --ignore-installed --report`): pip reads each
wheel's metadata from the registry and downloads no CUDA wheel, so the GPU lock is made on a CPU machine.
The resolution is for the python and platform it runs on (CI's: CPython 3.11, Linux x86_64); on another
python a pin the lock lacks is resolved freely (a constraint never adds a package).

    python .ci/locks.py write [NAME ...]   regenerate (about a minute each; needs the registry)
    python .ci/locks.py check [NAME ...]   fail unless each lock is current: resolving pyproject.toml's
                                           requirements under it installs exactly its pins (nothing unpinned,
                                           no pin left over), so a changed requirement fails CI until the
                                           lock is regenerated; new releases on the registry change nothing
    python .ci/locks.py dry-run NAME -- ARGS   the resolution only, of `pip install ARGS` under that lock
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (file, what is installed: pip's own arguments, extra pins for the resolution)
LOCKS = {
    "cpu": ("constraints.txt", ["-e", ".[test]"], ["torch==2.13.0"]),
    "gpu": ("constraints-gpu.txt", ["-e", ".[gpu,test]"], []),
}
# pip itself is pinned too (the install commands upgrade pip under the lock first); the project is not.
ALWAYS = ["pip"]
SELF = "augtree-verl"
HEADER = "# Exact versions for the {name} install. Regenerate with: bash .ci/lock ({how})\n"
HOW = {"cpu": "what CI installs and tests", "gpu": "verl 0.9.1's vllm extra; resolution checked by CI"}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(v: str) -> str:
    # A local build label (torch's +cpu) is dropped: the same pin serves the CUDA build of that version.
    return v.split("+", 1)[0]


def resolve(pip_args: list[str], constraint: str | None = None) -> dict[str, str]:
    """{canonical name: version} that `pip install pip_args` would install into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", report]
        if constraint:
            cmd += ["-c", constraint]
        proc = subprocess.run(cmd + pip_args, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            noise = "is ignored: it is neither a file nor a directory"
            err = "\n".join(line for line in proc.stderr.splitlines() if noise not in line)
            raise SystemExit(f"pip could not resolve `pip install {' '.join(pip_args)}`"
                             f"{' -c ' + constraint if constraint else ''}:\n{err[-4000:]}")
        with open(report) as f:
            items = json.load(f)["install"]
    return {_canon(i["metadata"]["name"]): _version(i["metadata"]["version"]) for i in items
            if _canon(i["metadata"]["name"]) != SELF}


def read(path: str) -> dict[str, str]:
    pins = {}
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[_canon(name)] = version
    return pins


def write(name: str) -> None:
    path, args, extra = LOCKS[name]
    pins = resolve(ALWAYS + extra + args)
    with open(os.path.join(ROOT, path), "w") as f:
        f.write(HEADER.format(name=name.upper(), how=HOW[name]))
        f.writelines(f"{n}=={v}\n" for n, v in sorted(pins.items()))
    print(f"{path}: {len(pins)} pins")


def check(name: str) -> list[str]:
    path, args, _ = LOCKS[name]
    pins = read(path)
    got = resolve(ALWAYS + args, os.path.join(ROOT, path))
    problems = [f"{path}: {n}=={v} is installed but not pinned" for n, v in sorted(got.items()) if n not in pins]
    problems += [f"{path}: pins {n}=={v}, which nothing requires" for n, v in sorted(pins.items()) if n not in got]
    problems += [f"{path}: pins {n}=={pins[n]}, resolution gives {v}" for n, v in sorted(got.items())
                 if n in pins and pins[n] != v]
    print(f"{path}: {'current' if not problems else 'STALE'} ({len(pins)} pins, {len(got)} resolved)")
    return problems


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("write", "check", "dry-run"):
        print(__doc__)
        return 2
    if argv[0] == "dry-run":
        name, sep, rest = argv[1], argv[2], argv[3:]
        assert sep == "--", "usage: dry-run NAME -- ARGS"
        got = resolve(rest, os.path.join(ROOT, LOCKS[name][0]))
        print(f"resolves: pip install {' '.join(rest)} -c {LOCKS[name][0]} ({len(got)} packages; "
              + ", ".join(f"{n} {got[n]}" for n in ("torch", "vllm", "transformers", "verl") if n in got) + ")")
        return 0
    names = argv[1:] or list(LOCKS)
    if argv[0] == "write":
        for name in names:
            write(name)
        return 0
    problems = [p for name in names for p in check(name)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print("regenerate with: bash .ci/lock", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
