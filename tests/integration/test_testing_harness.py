"""``augtree_verl.testing`` imports without side effects; ``use_cpu_platform`` selects verl's CPU platform, and
refuses once verl has fixed another device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import augtree_verl

pytestmark = pytest.mark.slow  # subprocesses that import verl

REPO = Path(augtree_verl.__file__).parents[1]
PLATFORM_ENV = ("VERL_PLATFORM", "TORCHINDUCTOR_CACHE_DIR")

# Third-party imports first: tensordict sets TORCHINDUCTOR_CACHE_DIR itself when imported.
IMPORT_THEN_SELECT = """
import json, os, sys
import tensordict, torch.distributed as dist, transformers
before = dict(os.environ)
from augtree_verl.testing import harness, verl_batch
after_import = {"verl": "verl" in sys.modules, "env_changed": dict(os.environ) != before,
                "process_group": dist.is_initialized()}
harness.use_cpu_platform()
from verl.utils.device import get_device_name
print(json.dumps({"after_import": after_import, "device": get_device_name(), "platform": os.environ["VERL_PLATFORM"]}))
"""

TOO_LATE = """
import verl
from verl.utils.device import get_device_name
get_device_name()  # fixes verl's device (cuda: no VERL_PLATFORM)
from augtree_verl.testing import harness
harness.use_cpu_platform()
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_import_has_no_side_effects_and_use_cpu_platform_selects_cpu():
    done = _run(IMPORT_THEN_SELECT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["after_import"] == {"verl": False, "env_changed": False, "process_group": False}
    assert found["device"] == "cpu" and found["platform"] == "cpu"


@pytest.mark.timeout(300)
def test_use_cpu_platform_refuses_after_verl_fixed_another_device():
    done = _run(TOO_LATE)
    assert done.returncode != 0
    assert "RuntimeError: verl resolved its device to 'cuda' before use_cpu_platform()" in done.stderr, \
        done.stderr[-3000:]
