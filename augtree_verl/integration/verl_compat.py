"""The one place that touches verl's private names (each function says which and why)."""

from __future__ import annotations


def serve_strategy_in_detach_actor_worker(engine_workers_module, strategy: str) -> None:
    """verl/experimental/separation/engine_workers.py ``DetachActorWorker._get_strategy_handlers`` raises
    NotImplementedError for strategies it does not list; make it give ``strategy`` FSDP2's CPU save/restore
    handlers (an FSDP2-sharded module), the others unchanged. Idempotent."""
    worker_cls = engine_workers_module.DetachActorWorker
    original = worker_cls._get_strategy_handlers
    if getattr(original, "served_strategy", None) == strategy:
        return

    def _get_strategy_handlers(self):
        if self._strategy_handlers is None and self.config.actor.strategy == strategy:
            from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu, fsdp2_sharded_save_to_cpu

            self._strategy_handlers = (fsdp2_sharded_save_to_cpu, fsdp2_sharded_load_from_cpu)
        return original(self)

    _get_strategy_handlers.served_strategy = strategy
    worker_cls._get_strategy_handlers = _get_strategy_handlers
