"""The CPU rollout backend ``hf`` for verl 0.9.1: ``actor_rollout_ref.rollout.name=hf``.

verl registers only GPU rollouts (vllm, sglang, trtllm). This backend lets the whole RL loop run without a
GPU (tests, laptops); on GPUs use vLLM. Two halves, as verl's own backends have:

- ``HFReplica`` (driver side, ``RolloutReplicaRegistry``): one replica per ``tensor_model_parallel_size``
  trainer workers; it starts one ``hf_server.HFRolloutServer`` actor (``num_cpus=0``: it shares the
  workers' CPUs) on the node of the replica's first worker.
- ``HFServerAdapter`` (trainer-worker side, built on every rank in ``init_model``): ``update_weights``
  walks the weight generator on every rank (FSDP gathers each full tensor collectively) and the replica's
  first rank ships the state dict and the step to its server. ``resume``/``release`` are no-ops. In
  separate_async's standalone rollout pool the adapter runs in verl's rollout workers instead, fed by the
  checkpoint engine (``checkpoint_engine``, the CPU engine ``gloo``).

Reproducible runs: with one replica (``tensor_model_parallel_size`` = the number of trainer workers) every
request goes to one server, whose sampling is seeded (see ``hf_server``). With several replicas verl's router
spreads a group's requests by load, so which replica (and seed) serves which request may vary.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Generator

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.rollout.utils import ensure_async_iterator

from augtree_verl.integration import verl_compat
from augtree_verl.rollout.hf_server import HFRolloutServer

NAME = "hf"


def server_name(replica_rank: int, suffix: str = "") -> str:
    """The Ray actor name of a replica's server (the adapter looks it up by this name)."""
    return f"{NAME}_server_{replica_rank}{suffix}"


class HFReplica(RolloutReplica):
    """A rollout replica served by one ``HFRolloutServer`` actor (see the module docstring)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        if self.nnodes != 1:
            raise ValueError(
                f"the hf rollout runs a replica on one node; this one spans {self.nnodes} "
                f"(tensor_model_parallel_size {self.world_size} > n_gpus_per_node {self.gpus_per_node})"
            )
        options = dict(
            name=server_name(self.replica_rank, self.name_suffix), num_cpus=0, max_concurrency=self.max_concurrency
        )
        if self.workers:  # hybrid: next to the replica's first trainer worker
            node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        server = (
            ray.remote(HFRolloutServer)
            .options(**options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.wake_up.remote()  # returns once the model is loaded
        # The router keys servers by address; there is no HTTP endpoint, so the address is the actor's name.
        verl_compat.set_replica_server(self, server, address=options["name"])


class HFServerAdapter(BaseRollout):
    """Trainer-side half of the ``hf`` rollout: ships the actor's weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        replica_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_world_size if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % replica_world_size == 0
        self._server = None

    def _server_actor(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None] | AsyncGenerator[tuple[str, torch.Tensor], None],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise ValueError(f"the hf rollout takes full named tensors, got wire_format={wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("the hf rollout does not load LoRA adapters; set actor_rollout_ref.model.lora.merge=true")
        # Every rank walks the weights: a trainer's generator gathers each full tensor collectively; a
        # checkpoint engine's (separate_async's rollout pool) hands out views of its receive buffer.
        state_dict = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_leader_rank:
                state_dict[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader_rank:
            await self._server_actor().load_weights.remote(state_dict, global_steps)
