"""Packaging of the GPU path: the `gpu` extra needs no flash-attn (a separate optional extra has it), and the
GPU image installs the package with the project's lock file on top of a CUDA base image."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_extra_without_flash_attn_and_a_flash_attn_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [d for d in extras["gpu"] if d.lower().replace("_", "-").startswith("flash-attn")], extras["gpu"]
    assert [d for d in extras["flash-attn"] if d.startswith("flash-attn")], extras["flash-attn"]


def test_dockerfile_installs_with_the_lock_file_and_checks_cuda_torch():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'pip install -c constraints.txt -e ".[gpu]"' in text
    assert "torch.version.cuda" in text and "_flash_attention_forward" in text
