"""The run's planner profile: made by the training engine at start-up, read by the driver's trainer.

``AugTreeEngine.initialize`` (the actor's engine; a forward-only engine, e.g. the reference model's, makes
none) calls ``make_run_profile``: the model shape from the engine's Hugging Face config, the dtype its layers
compute in (the start-up exactness probe's), activation checkpointing from verl's model config, and the
hardware figures from ``planner_profile``, the cache or a calibration on this device and the world process
group (its CP fixed costs fitted only where ``cp_degrees`` has a degree above 1; ``planner.startup``; every
rank takes part and gets the same profile, with which its engine plans its steps: ``StepPlan.build``'s
``trie_cost``). The result stays in this worker process; the trainer
reads rank 0's with ``planner.startup.published_profile`` (run there through the worker group,
``verl_compat.run_on_rank_zero``), prints it once and plans with it: the planner service, its client and
the plans the engine applies all come from that one profile.
"""

from __future__ import annotations

import dataclasses

import torch

from augtree_verl.integration import verl_compat
from augtree_verl.integration.fsdp_model import FSDPReplayModel
from augtree_verl.planner.profile import ClusterProfile
from augtree_verl.planner.startup import RunProfile, publish, startup_profile


def make_run_profile(engine) -> RunProfile:
    """The profile of the run ``engine`` (an initialised ``AugTreeEngine`` that trains) takes part in; a
    collective over the world. Published in this process for the trainer (``planner.startup.publish``)."""
    world = torch.distributed.get_world_size()
    model = FSDPReplayModel(engine.module)
    base = dataclasses.replace(
        ClusterProfile.default().with_model(engine.module.config),
        dtype_bytes=engine.exactness_probe.dtype.itemsize,
        activation_checkpointing=bool(engine.model_config.enable_gradient_checkpointing),
        ranks_per_node=verl_compat.ranks_per_node(world),
    )
    group = torch.distributed.group.WORLD if world > 1 else None
    params = list(engine.module.parameters())
    saved = [p.grad for p in params]  # the calibration's replays accumulate into them
    try:
        with engine.train_mode():
            run = startup_profile(
                base,
                user_file=engine.engine_config.planner_profile,
                device=model.get_input_embeddings().weight.device,
                group=group,
                model=model,
                lockstep_group=group,
                context_parallel=max(engine.engine_config.cp_degrees) > 1,
            )
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    publish(run)
    return run
