"""verl integration: the ``augtree`` engine backend (and a CPU platform), loaded by ``import verl``.

This package is verl's ``verl.plugins`` entry point, so ``import verl`` imports it in every process (driver
and Ray workers). Importing it is cheap and idempotent:
- registers the CPU platform (``VERL_PLATFORM=cpu`` selects it; see ``cpu_platform``);
- arranges that ``AugTreeEngine`` is registered with verl's ``EngineRegistry`` as backend "augtree" for
  language models once verl imports ``verl.workers.engine`` (see ``import_hooks`` for why not at once);
- likewise registers the CPU rollout backend ``hf`` (``augtree_verl.rollout``) once verl imports its rollouts.
"""

from augtree_verl.integration import cpu_platform  # noqa: F401
from augtree_verl.integration.registration import register_engine_when_verl_loads, register_rollout_when_verl_loads

register_engine_when_verl_loads()
register_rollout_when_verl_loads()
