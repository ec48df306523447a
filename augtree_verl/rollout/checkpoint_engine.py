"""The CPU checkpoint engine ``gloo``: the trainer's weights to a standalone rollout pool over a gloo group.

verl's separate-async mode pushes the actor's weights after every ``parameter_sync_step`` mini-batches to a
rollout pool on its own workers through a checkpoint engine (``rollout.checkpoint_engine.backend``), and
refuses ``naive``; every other engine verl 0.9.1 ships needs GPU libraries. This one needs torch only.
Select it with

    actor_rollout_ref.rollout.checkpoint_engine.backend=gloo
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=augtree_verl.rollout.checkpoint_engine

(``examples/run_cpu.sh`` does). verl imports ``custom_backend_module`` on the trainer workers, the rollout
workers and the driver before it looks the backend up, which registers it.

Per weight sync (verl's ``CheckpointEngineManager.update_weights``): ``prepare`` starts a TCP store on
trainer rank 0 (``is_master``); ``build_topology`` puts trainer rank 0 (the sender) and every rollout worker
(receivers) into one gloo group, the other trainer ranks outside it (rank -1: they walk the weight generator,
whose FSDP gathers are collective, and send nothing); ``init_process_group`` joins it; ``send_weights`` cuts
the weights into buckets of at most ``bucket_size`` bytes (``rollout.checkpoint_engine.
update_weights_bucket_megabytes``; a larger tensor goes in chunks, as verl's NCCL engine does) and broadcasts
each bucket, with its metadata, while it fills the next one; ``receive_weights`` yields the full tensors;
``finalize`` drops the group and the buffers. Bytes are copied as they are: the rollout gets the trainer's
tensors bit for bit.

The sender returns ``augtree/weight_sync/{bytes,buckets,tensors,send_s}``, which verl logs with the step.
"""

from __future__ import annotations

import asyncio
import datetime
import pickle
import time
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "gloo"
SENDER = 0
OUTSIDE = -1  # the rank of a trainer worker that walks the weights but is not in the group
# Each chunk starts at a multiple of this many bytes in its bucket: the receiver views a chunk as its dtype,
# which needs an offset that dtype's size divides (a 7-element bf16 tensor must not misalign an int64 after it).
ALIGN = 16


@dataclass(frozen=True)
class StoreAddress:
    """Where the sender's TCP store listens (``prepare`` on the master returns it)."""

    host: str
    port: int


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast of the weights from trainer rank 0 to every rollout worker, over gloo (see the module).

    ``bucket_size``: bytes per bucket (the sender holds two buckets, a receiver one, during a sync: verl's
    default 2048 MB is 4 GB of host memory on trainer rank 0 for a model that large; set
    ``update_weights_bucket_megabytes`` to what the hosts can spare). ``is_master``: trainer rank 0 (verl
    passes it on the trainer side only). ``timeout_s``: the group's timeout for each collective
    (``engine_kwargs.gloo.timeout_s``).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0) -> None:
        if bucket_size <= 0:
            raise ValueError(f"checkpoint engine {BACKEND}: bucket_size must be > 0 bytes, got {bucket_size}")
        if timeout_s <= 0:
            raise ValueError(f"checkpoint engine {BACKEND}: timeout_s must be > 0, got {timeout_s}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self._store: dist.TCPStore | None = None
        self._group: Any = None  # a ProcessGroupGloo (torch's stubs lack its collectives)

    def prepare(self) -> StoreAddress | None:
        """On the master: a new TCP store on a free port of this node, and its address; elsewhere None."""
        if not self.is_master:
            return None
        host = ray.util.get_node_ip_address().strip("[]")
        self._store = dist.TCPStore(host, 0, is_master=True, timeout=self.timeout, wait_for_workers=False)
        return StoreAddress(host, self._store.port)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict[str, list], dict[str, list]]:
        """Trainer rank 0 sends (group rank 0), the other trainer ranks stay out, rollout worker i is rank i + 1.

        ``metadata``: ``prepare``'s results, trainer workers first.
        """
        master = metadata[0]
        if not isinstance(master, StoreAddress):
            raise ValueError(
                f"checkpoint engine {BACKEND}: trainer rank 0 must be the master (is_master=True) "
                f"and return its store address from prepare, got {master!r}"
            )
        world_size = 1 + rollout_world_size
        actor: dict[str, list] = {
            "rank": [SENDER] + [OUTSIDE] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout: dict[str, list] = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: StoreAddress) -> None:
        """Join the group (blocks until all ``world_size`` members joined); rank -1 joins nothing."""
        self.rank = rank
        if rank == OUTSIDE:
            return
        store = (
            self._store
            if rank == SENDER
            else dist.TCPStore(master.host, master.port, is_master=False, timeout=self.timeout)
        )
        if store is None:
            raise ValueError(f"checkpoint engine {BACKEND}: rank {SENDER} must be the master that ran prepare")
        self._group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)

    def finalize(self) -> None:
        self._group = None
        self._store = None
        self.rank = None

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` (any shape; the sender's is read, the others' written) from the sender.
        gloo matches a group's collectives by the order they were started in."""
        return self._group.broadcast([tensor], dist.BroadcastOptions())  # root 0 by default: the sender

    @staticmethod
    async def _wait(works: list) -> None:
        await asyncio.to_thread(lambda: [work.wait() for work in works])

    def _send_bucket(self, bucket: torch.Tensor, metas: list, is_last: bool) -> list:
        """Start sending the sizes, the pickled chunk metadata and the bytes ``bucket`` [n] uint8."""
        header = torch.frombuffer(bytearray(pickle.dumps((metas, is_last))), dtype=torch.uint8)
        sizes = torch.tensor([header.numel(), bucket.numel()], dtype=torch.int64)
        return [self._broadcast(sizes), self._broadcast(header), self._broadcast(bucket)]

    @torch.no_grad()
    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        """Send every (name, tensor) of ``weights`` (rank 0); walk them only (rank -1). Returns the sync's figures."""
        if self.rank is None:
            raise ValueError(f"checkpoint engine {BACKEND}: send_weights before init_process_group")
        if self.rank == OUTSIDE:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != SENDER:
            raise ValueError(f"checkpoint engine {BACKEND}: rank {self.rank} is a receiver, not the sender")
        start = time.perf_counter()
        buckets = [torch.empty(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        in_flight: list = []  # the works sending the other bucket
        metas: list = []
        offset = payload = count = tensors = 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            offset = -(-offset // ALIGN) * ALIGN
            if offset + meta.chunk_size > self.bucket_size:
                # send this bucket while the other one, once its own send is done, fills
                works = self._send_bucket(buckets[0][:offset], metas, False)
                await self._wait(in_flight)
                in_flight = works
                buckets.reverse()
                count, metas, offset = count + 1, [], 0
            meta.offset = offset
            metas.append(meta)
            buckets[0][offset : offset + meta.chunk_size].copy_(chunk)
            offset += meta.chunk_size
            payload += meta.chunk_size
            tensors += meta.chunk_offset == 0
        await self._wait(in_flight + self._send_bucket(buckets[0][:offset], metas, True))
        return {
            "augtree/weight_sync/bytes": float(payload),
            "augtree/weight_sync/buckets": float(count + 1),
            "augtree/weight_sync/tensors": float(tensors),
            "augtree/weight_sync/send_s": time.perf_counter() - start,
        }

    async def _receive_chunks(self) -> AsyncGenerator:
        """(chunk metadata, bytes) of every bucket; a bucket's views stay valid until the next is received."""
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        is_last = False
        while not is_last:
            sizes = torch.empty(2, dtype=torch.int64)
            await self._wait([self._broadcast(sizes)])
            header_size, size = int(sizes[0]), int(sizes[1])
            if size > self.bucket_size:
                raise ValueError(
                    f"checkpoint engine {BACKEND}: the sender's bucket has {size} bytes, this "
                    f"receiver's bucket_size is {self.bucket_size}: give both the same bucket size"
                )
            header = torch.empty(header_size, dtype=torch.uint8)
            await self._wait([self._broadcast(header), self._broadcast(bucket[:size])])
            metas, is_last = pickle.loads(header.numpy().tobytes())
            for meta in metas:
                yield meta, bucket[meta.offset : meta.offset + meta.chunk_size]

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield every (name, tensor) the sender sends, in its order. A tensor may be a view of the receive
        buffer: copy it before asking for the next."""
        if self.rank is None or self.rank <= SENDER:
            raise ValueError(f"checkpoint engine {BACKEND}: receive_weights on rank {self.rank}, not a receiver")
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, tensor
