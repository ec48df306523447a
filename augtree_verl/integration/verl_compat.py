"""Every verl internal augtree-verl relies on, in one place, and the verl version they were checked against.

verl's public API does not cover all an engine backend and a trainer mode need: a registry's dict, a worker
group's dispatch cache, a config's frozen fields, a trainer's private helpers. Each use of one is a small
function here (its docstring names the verl file and name it touches, and why), so that moving to a new verl
means reading this file. Private methods of verl classes that our subclasses override (verl calls them) are
listed in ``PRIVATE_OVERRIDES``; the public verl names the other modules use are listed in ``VERL_NAMES``.
``tests/integration/test_verl_compat.py`` fails if any other module of the package touches a verl private
name, patches a verl module, spells a verl dunder key, or uses a verl name ``VERL_NAMES`` lacks.

Importing this module checks the installed verl against ``TESTED_VERL`` and raises ``VerlVersionError``
naming both versions when they differ; ``AUGTREE_ALLOW_VERL_VERSION=1`` turns that into a warning (at your
own risk: the names below may have changed). This module imports no verl module at import time (it is
imported inside ``import verl``, through the plugin entry point).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings

TESTED_VERL = "0.9.1"
ALLOW_VERSION_ENV = "AUGTREE_ALLOW_VERL_VERSION"

logger = logging.getLogger(__name__)

# Private methods of verl classes that our subclasses override, because verl calls them (name: what and why).
PRIVATE_OVERRIDES = {
    "_build_fsdp_module": "verl/workers/engine/fsdp/transformer_impl.py FSDPEngine._build_fsdp_module branches "
    "on engine_config.strategy, which it knows as fsdp/fsdp2 only: AugTreeEngine builds as "
    "fsdp2",
    "_init_device_mesh": "verl/workers/engine/fsdp/transformer_impl.py FSDPEngine._init_device_mesh, run by "
    "initialize() before verl asks the data-parallel layout: AugTreeEngine builds its CP mesh",
    "_balance_batch": "verl/trainer/ppo/v1/trainer_base.py PPOTrainer._balance_batch, called each step to order "
    "the batch over data-parallel ranks: AugTreeTrainerMixin balances whole groups",
    "_run_prompt": "verl/trainer/ppo/v1/agent_loop_tq.py AgentLoopWorkerTQ._run_prompt runs one uid's n sessions "
    "and marks the group finished: PlannerFeedWorker opens the group's length record around it",
    "_agent_loop_postprocess": "verl/trainer/ppo/v1/agent_loop_tq.py AgentLoopWorkerTQ._agent_loop_postprocess "
    "puts one session's samples into the TransferQueue: PlannerFeedWorker records their "
    "lengths and reports the group to the planner once its n sessions are in; it "
    "stores a branching loop's leaves as sessions of their own",
    "_process_multi_modal_info": "verl/utils/dataset/rl_dataset.py RLHFDataset._process_multi_modal_info reads a "
    "row's images (for the overlong filter and the agent loop) with qwen_vl_utils, which imports torchvision: "
    "cpu_loop.image_dataset.ImageRLHFDataset reads them with PIL alone",
    "_handle_generating_state": "verl/experimental/agent_loop/tool_agent_loop.py ToolAgentLoop."
    "_handle_generating_state runs one assistant turn: BranchingAgentLoop lets its "
    "environment reply where verl would end the trajectory",
}

# The public verl names every other module of the package uses (imports, and attributes of verl modules it
# imported), by module: moving to a new verl, check these too. tests/integration/test_verl_compat.py fails on a
# verl name used anywhere else and not listed here, on a listed name no module uses, and on a listed name the
# installed verl lacks.
VERL_NAMES = {
    "bench/verl_fsdp2.py": (
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.assign_non_tensor",
    ),
    "cpu_loop/reward.py": ("verl.utils.reward_score.default_compute_score",),
    "cpu_loop/tools.py": (
        "verl.experimental.agent_loop.tool_parser.FunctionCall",
        "verl.experimental.agent_loop.tool_parser.ToolParser",
        "verl.tools.base_tool.BaseTool",
        "verl.tools.schemas.OpenAIFunctionToolSchema",
        "verl.tools.schemas.ToolResponse",
    ),
    "integration/batch_trees.py": (
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.get",
    ),
    "integration/config.py": ("verl.workers.config.FSDPEngineConfig",),
    "integration/cpu_platform.py": (
        "verl.plugin.platform.PlatformBase",
        "verl.plugin.platform.PlatformRegistry",
        "verl.plugin.platform.get_platform",
    ),
    "integration/engine.py": (
        "verl.utils.dataset.dataset_utils.DatasetPadMode",
        "verl.utils.device.get_device_id",
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.assign_non_tensor",
        "verl.utils.tensordict_utils.concat_tensordict",
        "verl.utils.tensordict_utils.get_non_tensor_data",
        "verl.utils.tensordict_utils.index_select_tensor_dict",
        "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead",
        "verl.workers.engine.utils.postprocess_batch_func",
        "verl.workers.engine.utils.prepare_micro_batches",
    ),
    "integration/loss_calls.py": (
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.get",
        "verl.workers.utils.losses.ppo_loss",
    ),
    "integration/metrics.py": (
        "verl.utils.metric.AggregationType",
        "verl.utils.metric.Metric",
    ),
    "rollout/agent_loop.py": (
        "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopManagerTQ",
        "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopWorkerTQ",
    ),
    "rollout/branching.py": (
        "verl.experimental.agent_loop.tool_agent_loop.AgentState",
        "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop",
    ),
    "rollout/checkpoint_engine.py": (
        "verl.checkpoint_engine.base.CheckpointEngine",
        "verl.checkpoint_engine.base.CheckpointEngineRegistry",
        "verl.checkpoint_engine.base.merge_weight_chunks",
        "verl.checkpoint_engine.base.split_weight_chunks",
        "verl.workers.rollout.utils.ensure_async_iterator",
    ),
    "rollout/hf.py": (
        "verl.workers.rollout.base.BaseRollout",
        "verl.workers.rollout.replica.RolloutReplica",
        "verl.workers.rollout.utils.ensure_async_iterator",
    ),
    "rollout/hf_server.py": (
        "verl.utils.config.omega_conf_to_dataclass",
        "verl.workers.config.HFModelConfig",
        "verl.workers.rollout.replica.TokenOutput",
        "verl.utils.model.get_hf_auto_model_class",
    ),
    "rollout/multimodal.py": ("verl.utils.tokenizer.get_processor_token_id",),
    "cpu_loop/image_dataset.py": ("verl.utils.dataset.rl_dataset.RLHFDataset",),
    "rollout/planner_config.py": ("verl.utils.config.omega_conf_to_dataclass",),
    "testing/harness.py": (
        "verl",
        "verl.trainer.config.CheckpointConfig",
        "verl.utils.device.get_device_name",
        "verl.workers.config.FSDPActorConfig",
        "verl.workers.config.FSDPEngineConfig",
        "verl.workers.config.FSDPOptimizerConfig",
        "verl.workers.config.HFModelConfig",
        "verl.workers.engine.EngineRegistry",
        "verl.workers.utils.losses.ppo_loss",
    ),
    "testing/verl_batch.py": (
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.get_tensordict",
    ),
    "trainer/augtree_async.py": (
        "verl.trainer.ppo.v1.PPOTrainerColocateAsync",
        "verl.trainer.ppo.v1.PPOTrainerSeparateAsync",
        "verl.trainer.ppo.v1.register_trainer",
    ),
    "trainer/augtree_sync.py": (
        "verl.trainer.ppo.v1.PPOTrainerSync",
        "verl.trainer.ppo.v1.register_trainer",
    ),
    "trainer/group_aware.py": (
        "transfer_queue",
        "transfer_queue.KVBatchMeta",
        "transfer_queue.kv_batch_get",
        "transfer_queue.kv_batch_put",
        "verl.trainer.ppo.padding_utils.upsample_batch_to_divisible_size",
        "verl.utils.debug.marked_timer",
        "verl.utils.seqlen_balancing.log_seqlen_unbalance",
        "verl.utils.tensordict_utils",
        "verl.utils.tensordict_utils.get_tensordict",
    ),
    "trainer/group_balance.py": ("verl.utils.seqlen_balancing.get_seqlen_balanced_partitions",),
}


class VerlVersionError(RuntimeError):
    """The installed verl is not the version augtree-verl was tested with."""


def check_verl_version() -> None:
    """importlib.metadata's version of "verl" against TESTED_VERL: VerlVersionError (a warning with the env var)."""
    try:
        installed = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed == TESTED_VERL:
        return
    found = f"verl {installed} is installed" if installed else "verl is not installed"
    message = (
        f"augtree-verl is tested with verl {TESTED_VERL}, but {found}. Install verl=={TESTED_VERL}, or set "
        f"{ALLOW_VERSION_ENV}=1 to run anyway (the verl internals in {__name__} may have changed)."
    )
    if os.environ.get(ALLOW_VERSION_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    # verl loads plugins inside ``import verl`` and logs their errors at debug level only: say it here too.
    logger.error(message)
    raise VerlVersionError(message)


def registered_engine_devices(registry, model_type: str, backend: str) -> set:
    """verl/workers/engine/base.py EngineRegistry._engines: devices ``backend`` has (register asserts on repeats)."""
    return set(registry._engines.get(model_type, {}).get(backend, {}))


def engine_config_post_init(config) -> None:
    """verl/workers/config/engine.py EngineConfig.__post_init__, not FSDPEngineConfig's (it asserts away "augtree")."""
    from verl.workers.config.engine import EngineConfig

    EngineConfig.__post_init__(config)


def set_frozen_field(config, name: str, value) -> None:
    """verl/base_config.py BaseConfig.__setattr__ freezes fields not in _mutable_fields: set ``name`` anyway."""
    object.__setattr__(config, name, value)


def dispatch_dp_size(worker_group, mesh_name: str) -> int:
    """verl/single_controller/base/decorator.py: DP size from _dispatch_info (_query_dispatch_info), as verl gets it."""
    if mesh_name not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh_name] = worker_group._query_dispatch_info(mesh_name)
    return max(worker_group._dispatch_info[mesh_name]) + 1


def run_on_rank_zero(worker_group, fn, *args):
    """verl/single_controller/base/worker.py Worker.execute_func_rank_zero (registered ALL_TO_ALL, executed on
    rank 0): ``fn(*args)`` in the rank-0 worker process of ``worker_group``, its result returned. ``fn`` must be
    importable there (a module-level function)."""
    return worker_group.execute_func_rank_zero(fn, *args)


def ranks_per_node(world: int) -> int:
    """verl/single_controller/ray/base.py RayWorkerGroup._create_worker sets ``RAY_LOCAL_WORLD_SIZE`` (the
    worker processes per node of the resource pool) in every worker's environment; ``world`` outside one."""
    return int(os.environ.get("RAY_LOCAL_WORLD_SIZE") or world)


def required_batch_multiple(trainer, dp_size: int) -> int:
    """verl/trainer/ppo/v1/trainer_base.py PPOTrainer._get_required_batch_multiple: what verl's _balance_batch
    pads the batch to."""
    return trainer._get_required_batch_multiple(dp_size)


def trainer_mode_as(verl_mode: str) -> property:
    """verl/trainer/ppo/v1/trainer_base.py PPOTrainer branches on ``self.trainer_mode`` ("sync" or not) and reads
    ``trainer.v1.<trainer_mode>``: a property answering ``verl_mode``, the verl mode a registered mode extends."""

    def get(self) -> str:
        return verl_mode

    def set_registered_name(self, registered_name: str) -> None:
        # PPOTrainer.__init__ assigns the registered mode (config trainer.v1.trainer_mode); keep it readable.
        self.registered_trainer_mode = registered_name

    return property(get, set_registered_name)


def ray_actor_class(actor_class):
    """verl/trainer/ppo/v1/agent_loop_tq.py AgentLoopWorkerTQ is a Ray actor class (``@ray.remote``), which Ray
    forbids subclassing: its Python class, ``__ray_actor_class__`` (as verl's single_controller/ray/base.py does)."""
    return actor_class.__ray_actor_class__


def serve_strategy_in_detach_actor_worker(engine_workers_module, strategy: str) -> None:
    """verl/experimental/separation/engine_workers.py DetachActorWorker._get_strategy_handlers raises
    NotImplementedError for strategies it does not list: give ``strategy`` FSDP2's CPU save/restore handlers
    (an FSDP2-sharded module), the others unchanged. Idempotent."""
    worker_cls = engine_workers_module.DetachActorWorker
    original = worker_cls._get_strategy_handlers
    if getattr(original, "served_strategy", None) == strategy:
        return

    def _get_strategy_handlers(self):
        if self._strategy_handlers is None and self.config.actor.strategy == strategy:
            from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu, fsdp2_sharded_save_to_cpu

            self._strategy_handlers = (fsdp2_sharded_save_to_cpu, fsdp2_sharded_load_from_cpu)
        return original(self)

    _get_strategy_handlers.served_strategy = strategy  # type: ignore[attr-defined]  # a marker on the function
    worker_cls._get_strategy_handlers = _get_strategy_handlers


def quiet_separate_async_info_log() -> None:
    """verl/trainer/ppo/v1/trainer_separate_async.py PPOTrainerSeparateAsync._setup logs with
    ``logger.info(..., flush=True)`` when ``actor_rollout_ref.hybrid_engine=false``: a TypeError (``flush`` is
    print's keyword) whenever that module's logger has INFO on, as verl's default ``VERL_LOGGING_LEVEL`` has.
    Raise that one logger to WARNING."""
    separate_async_logger = logging.getLogger("verl.trainer.ppo.v1.trainer_separate_async")
    separate_async_logger.setLevel(max(separate_async_logger.getEffectiveLevel(), logging.WARNING))


def register_rollout_adapter(rollout_package_base, name: str, adapter_fqdn: str, mode: str = "async") -> None:
    """verl/workers/rollout/base.py _ROLLOUT_REGISTRY (no register function in 0.9.1): name the trainer-side rollout
    class ("module.Class") of backend ``name``, which ``get_rollout_class`` reads. Idempotent."""
    rollout_package_base._ROLLOUT_REGISTRY.setdefault((name, mode), adapter_fqdn)


def set_replica_server(replica, server, address: str) -> None:
    """verl/workers/rollout/replica.py RolloutReplica: ``launch_servers`` must set ``servers`` and the private
    ``_server_handle`` / ``_server_address`` (the router keys servers by address) of a one-server replica."""
    replica.servers = [server]
    replica._server_handle = server
    replica._server_address = address


def rollout_sessions(prompt: dict, default: int) -> int:
    """verl/trainer/ppo/v1/agent_loop_tq.py AgentLoopWorkerTQ._run_prompt runs ``prompt["__rollout_n__"]``
    sessions of a uid (and pops the key), else ``rollout.n``: how many sessions the group has."""
    return prompt.get("__rollout_n__", default)


def active_tool_schemas(agent_data) -> list[dict]:
    """verl/experimental/agent_loop/tool_agent_loop.py ToolAgentLoop.run keeps a trajectory's tool schemas (the
    row's ``tool_selection`` of the loop's tools) in ``agent_data._active_tool_schemas``: the schemas its
    chat-template renders take."""
    return agent_data._active_tool_schemas


def tq_session_and_index(key: str, uid: str) -> tuple[int, int] | None:
    """verl/trainer/ppo/v1/agent_loop_tq.py names a sample's TransferQueue key ``{uid}_{session}_{index}``
    (session of the uid, index of the output within the session): (session, index), or None for another form."""
    session, _, index = key[len(uid) + 1 :].partition("_")
    if not key.startswith(uid + "_") or not (session.isdigit() and index.isdigit()):
        return None
    return int(session), int(index)


def wrap_module_function(module, name: str, wrap) -> None:
    """Replace ``module.<name>`` (a verl function) by ``wrap(original)`` once (``wrap``'s result carries
    ``augtree_wrapped = True``), before verl's own modules bind it by name (``from ... import``). Used by the
    CPU platform on verl/utils/distributed.py initialize_global_process_group_ray (its backend string)."""
    original = getattr(module, name)
    if not getattr(original, "augtree_wrapped", False):
        wrapped = wrap(original)
        wrapped.augtree_wrapped = True
        setattr(module, name, wrapped)


def replace_module_name(module, name: str, replacement) -> None:
    """Rebind ``module.<name>`` (a name a verl module imported) to ``replacement``, for verl's code in that module.
    Used by the CPU platform on verl/workers/engine/fsdp/transformer_impl.py CPUOffloadPolicy (pinned memory)."""
    getattr(module, name)  # AttributeError if verl no longer has it
    setattr(module, name, replacement)


check_verl_version()
