"""Packaging of the GPU path: the `gpu` extra is verl's own `vllm` extra and needs no flash-attn (a separate
optional extra has it); the README's GPU command and the GPU image install one line, under the GPU lock, and the
image checks CUDA torch and the flash ops' binding, then runs the GPU check first. (CI resolves that line:
.ci/run; the lock's content: tests/test_packaging.py.)"""

import re
from pathlib import Path

import tomllib
from packaging.utils import canonicalize_name

from tests.test_packaging import _pins

ROOT = Path(__file__).resolve().parents[1]
GPU_LINE = 'pip install -c constraints-gpu.txt -e ".[gpu]"'


def test_gpu_extra_is_verls_vllm_extra_without_flash_attn_and_a_flash_attn_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == ["verl[vllm]==0.9.1"]
    assert [d for d in extras["flash-attn"] if d.startswith("flash-attn")], extras["flash-attn"]


def test_readme_and_dockerfile_install_the_same_gpu_line():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The GPU path") :]
    first_command = re.search(r"```bash\n(.*)\n", section).group(1)
    assert GPU_LINE in first_command and "constraints-gpu.txt pip" in first_command, first_command
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    assert GPU_LINE in docker
    assert "torch.version.cuda" in docker and "t.FORWARD, t.BACKWARD" in docker
    assert docker.rstrip().endswith('CMD ["python", "benchmarks/gpu_check.py"]')


def test_the_image_stack_agrees_with_the_gpu_lock():
    pins = _pins("constraints-gpu.txt")
    stack = [
        line
        for line in (ROOT / "docker" / "verl-gpu-stack.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    ]
    for line in stack:
        name, pinned = line.split("==")
        name = canonicalize_name(name)
        assert pins.get(name, pinned) == pinned, f"docker/verl-gpu-stack.txt pins {line}, the GPU lock {pins[name]}"
