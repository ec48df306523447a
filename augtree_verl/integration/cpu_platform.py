"""A CPU platform for verl 0.9.1 (which registers none): device "cpu", collectives over gloo.

verl resolves its device once per process through ``verl.plugin.platform.get_platform()``; without this
module a CPU host resolves to "cuda" and verl's engines fail. Importing this module registers the platform
under the name "cpu"; select it with ``VERL_PLATFORM=cpu``. It never auto-detects itself (its
``is_platform_available`` is False), so a CPU-only Ray driver of a GPU job keeps resolving to CUDA.

The import must happen after ``import verl`` and before ``verl.workers.engine`` is imported (that import
resolves the platform at module level). The ``verl.plugins`` entry point of this package
(``augtree_verl.integration``) imports this module, so ``import verl`` alone is enough in every process.

Importing this module also arranges that verl's stock fsdp/fsdp2 engine is registered for device "cpu"
once ``verl.workers.engine`` is imported (verl registers it for cuda/npu only), so ``strategy=fsdp2`` runs on
CPU too (the baseline of our parity tests), and fixes two places where verl assumes an accelerator, so that
verl's workers run on this platform (both changes apply only while the platform is "cpu"):

- ``verl.utils.distributed.initialize_global_process_group_ray`` (which verl's workers call at start) builds
  the backend string ``cpu:gloo,{device}:{backend}``, i.e. ``cpu:gloo,cpu:gloo`` here, which torch rejects
  ("Duplicate device type cpu"): on this platform it gets plain ``gloo``;
- verl's FSDP2 engine gives forward-only engines (the reference policy) and ``offload_policy`` engines a
  ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator: on this platform it does not pin.
"""

from __future__ import annotations

import functools
import os
import platform as _host
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform

from augtree_verl.integration import verl_compat
from augtree_verl.integration.import_hooks import after_import

CPU_PLATFORM = "cpu"


def _cpu_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def _mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of host memory, the CUDA ``mem_get_info`` contract."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _zero(*args, **kwargs) -> int:
    return 0


def _noop(*args, **kwargs) -> None:
    return None


# ``torch.cpu`` plus the calls verl's worker and engine code make on ``get_torch_device()`` that torch.cpu
# lacks (memory statistics, cache control, RNG state, memory fraction). Memory statistics are reported as 0:
# the host allocator keeps none.
CPU_DEVICE_MODULE = SimpleNamespace(
    **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")},
    empty_cache=_noop,
    ipc_collect=_noop,
    reset_peak_memory_stats=_noop,
    set_per_process_memory_fraction=_noop,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    mem_get_info=_mem_get_info,
    get_rng_state=_cpu_rng_state,
    set_rng_state=_cpu_set_rng_state,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_device_name=lambda device=None: _host.processor() or "cpu",
)


@PlatformRegistry.register(platform=CPU_PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform for host CPUs: tensors on "cpu", collectives over gloo, no IPC, no profiler."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Only an explicit VERL_PLATFORM=cpu selects this platform (see the module docstring).
        return False

    def current_device(self) -> str:
        # A string: verl passes it to ``.to()``, where an integer would mean a CUDA index.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _register_stock_fsdp_engine_for_cpu(engine_package) -> None:
    """Register verl's stock FSDP engine for device "cpu" (idempotent: ``register`` asserts on duplicates)."""
    registry = engine_package.EngineRegistry
    for backend in ("fsdp", "fsdp2"):
        if CPU_PLATFORM not in verl_compat.registered_engine_devices(registry, "language_model", backend):
            registry.register(model_type="language_model", backend=backend, device=CPU_PLATFORM)(
                engine_package.FSDPEngineWithLMHead
            )


after_import("verl.workers.engine", _register_stock_fsdp_engine_for_cpu)


def _on_cpu_platform() -> bool:
    return get_platform().device_name == CPU_PLATFORM


def _plain_gloo_on_cpu(initialize):
    """Wrap verl's ``initialize_global_process_group_ray``: on this platform its default backend is ``gloo``."""

    @functools.wraps(initialize)
    def wrapper(timeout_second=None, backend=None):
        if backend is None and _on_cpu_platform():
            backend = "gloo"
        return initialize(timeout_second=timeout_second, backend=backend)

    return wrapper


def _patch_process_group_init(distributed_module) -> None:
    """Install the wrapper before verl's workers bind the function by name (``from ... import``)."""
    verl_compat.wrap_module_function(distributed_module, "initialize_global_process_group_ray", _plain_gloo_on_cpu)


@dataclass
class HostOffloadPolicy(CPUOffloadPolicy):
    """FSDP2's ``CPUOffloadPolicy`` that does not pin memory on this platform (there is no accelerator)."""

    def __post_init__(self):
        if _on_cpu_platform():
            self.pin_memory = False


def _patch_offload_policy(transformer_impl) -> None:
    verl_compat.replace_module_name(transformer_impl, "CPUOffloadPolicy", HostOffloadPolicy)


after_import("verl.utils.distributed", _patch_process_group_init)
after_import("verl.workers.engine.fsdp.transformer_impl", _patch_offload_policy)
