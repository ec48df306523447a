"""verl integration: the ``augtree`` engine backend (and a CPU platform), loaded by ``import verl``.

This package is verl's ``verl.plugins`` entry point, so ``import verl`` imports it in every process (driver
and Ray workers). Importing it is cheap and idempotent:
- registers the CPU platform (``VERL_PLATFORM=cpu`` selects it; see ``cpu_platform``);
- arranges that ``AugTreeEngine`` is registered with verl's ``EngineRegistry`` as backend "augtree" for
  language models once verl imports ``verl.workers.engine`` (see ``import_hooks`` for why not at once);

The CPU rollout backend ``hf`` is registered by the ``augtree_trainer`` plugin (``augtree_verl.trainer``,
through ``augtree_verl.rollout.registration``): the rollout layer sits above this one.
"""

from augtree_verl.integration import cpu_platform  # noqa: F401
from augtree_verl.integration.registration import register_engine_when_verl_loads

register_engine_when_verl_loads()
