"""`import verl` alone, in a fresh interpreter, makes strategy "augtree" resolve to our engine (entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

PROBE = """
import json, sys
import verl
cheap = "verl.workers.engine" not in sys.modules       # registration waits for verl to import its engines
from verl.workers.engine import EngineRegistry
import verl.workers.engine as engines
cls = EngineRegistry.get_engine_cls("language_model", "augtree")
stock = EngineRegistry.get_engine_cls("language_model", "fsdp2")
import importlib, augtree_verl.integration as plugin
from augtree_verl.integration.registration import register_engine
importlib.reload(plugin)                                 # importing again ...
register_engine(engines)                                 # ... and registering again must not fail
from verl.utils.device import get_device_name

print(json.dumps({"cheap": cheap, "cls": f"{cls.__module__}.{cls.__qualname__}",
                  "stock": f"{stock.__module__}.{stock.__qualname__}", "device": get_device_name()}))
"""


def _probe(platform: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    if platform:
        env["VERL_PLATFORM"] = platform
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("augtree") == "augtree_verl.integration", (
        "the verl.plugins entry point is missing: install the package (pip install -e . --no-deps)"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("platform, device", [(None, "cuda"), ("cpu", "cpu")])
def test_import_verl_alone_resolves_augtree_to_our_engine(platform, device):
    found = _probe(platform)
    assert found["device"] == device
    assert found["cls"] == "augtree_verl.integration.engine.AugTreeEngine"
    assert found["stock"] == "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"
    assert found["cheap"], "import verl must not import verl.workers.engine (seconds, and fixes the platform)"
