"""The CPU checkpoint engine ``gloo`` (``augtree_verl.rollout.checkpoint_engine``) through verl's protocol: prepare on
every member, ``build_topology`` from their metadata, ``init_process_group`` with its arguments, then the trainer
ranks send (rank 0) or walk the weights (the others) while every rollout worker receives. The members run as
threads of this process, each with its own gloo group object (gloo does not care where its peers live)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry

from augtree_verl.rollout.checkpoint_engine import BACKEND, GlooCheckpointEngine

BUCKET = 4096  # bytes: the 40 x 40 float32 weight (6,400 bytes) goes in two chunks, small ones share buckets


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(40, 40, generator=gen),  # larger than a bucket
        "layers.0.norm.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
        "layers.0.q.weight": torch.randn(20, 20, generator=gen),  # 1,600 bytes
        "layers.0.count": torch.arange(5, dtype=torch.int64),
        "head.weight": torch.randn(30, 17, generator=gen),
    }  # 2,040 bytes


def _sync(actor_ranks: int, rollout_ranks: int, weights: dict[str, torch.Tensor], bucket: int = BUCKET):
    """One weight sync as verl's CheckpointEngineManager runs it: (sender's figures, each receiver's tensors)."""
    actors = [GlooCheckpointEngine(bucket, is_master=rank == 0, timeout_s=60) for rank in range(actor_ranks)]
    rollouts = [CheckpointEngineRegistry.new(BACKEND, bucket_size=bucket, timeout_s=60) for _ in range(rollout_ranks)]
    metadata = [engine.prepare() for engine in actors + rollouts]
    actor_kwargs, rollout_kwargs = GlooCheckpointEngine.build_topology(actor_ranks, rollout_ranks, metadata)
    members = [(e, {k: v[i] for k, v in actor_kwargs.items()}) for i, e in enumerate(actors)]
    members += [(e, {k: v[i] for k, v in rollout_kwargs.items()}) for i, e in enumerate(rollouts)]
    walked = []

    def generator():
        for name, tensor in weights.items():
            walked.append((threading.get_ident(), name))
            yield name, tensor

    async def receive(engine):
        return [(name, tensor.clone()) async for name, tensor in engine.receive_weights(global_steps=3)]

    def run(i: int):
        engine, kwargs = members[i]
        engine.init_process_group(**kwargs)
        try:
            if i < actor_ranks:
                return asyncio.run(engine.send_weights(generator(), global_steps=3))
            return asyncio.run(receive(engine))
        finally:
            engine.finalize()

    with ThreadPoolExecutor(len(members)) as pool:
        results = list(pool.map(run, range(len(members))))
    assert len(walked) == actor_ranks * len(weights), "every trainer rank walks every weight (FSDP gathers them)"
    return results[0], results[1:actor_ranks], results[actor_ranks:]


@pytest.mark.timeout(120)
def test_every_rollout_worker_gets_every_weight_bit_for_bit_in_order():
    weights = _weights()
    figures, others, received = _sync(actor_ranks=2, rollout_ranks=2, weights=weights)
    assert others == [{}], "a trainer rank outside the group sends nothing"
    for tensors in received:
        assert [name for name, _ in tensors] == list(weights)
        for name, tensor in tensors:
            assert tensor.dtype == weights[name].dtype and tensor.shape == weights[name].shape, name
            assert torch.equal(tensor.view(torch.uint8), weights[name].view(torch.uint8)), name
    total = sum(t.nbytes for t in weights.values())
    assert figures["augtree/weight_sync/bytes"] == total
    assert figures["augtree/weight_sync/tensors"] == len(weights)
    # buckets of at most 4096 bytes, filled in order, each chunk at a multiple of 16 bytes: embed 4096 |
    # embed 2304, norm 14 (+2), q 1600, count 40 | head 2040
    assert figures["augtree/weight_sync/buckets"] == 3


@pytest.mark.timeout(120)
def test_one_bucket_holds_everything_when_it_is_large_enough():
    weights = _weights()
    figures, _, (tensors,) = _sync(actor_ranks=1, rollout_ranks=1, weights=weights, bucket=1 << 20)
    assert figures["augtree/weight_sync/buckets"] == 1
    assert all(torch.equal(t, weights[n]) for n, t in tensors)


def test_bad_settings_and_topologies_are_refused_by_name():
    with pytest.raises(ValueError, match="bucket_size must be > 0 bytes, got 0"):
        GlooCheckpointEngine(0)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got -1"):
        GlooCheckpointEngine(BUCKET, timeout_s=-1)
    with pytest.raises(ValueError, match="trainer rank 0 must be the master"):
        GlooCheckpointEngine.build_topology(2, 1, [None, None, None])
    receiver = GlooCheckpointEngine(BUCKET)
    with pytest.raises(ValueError, match="send_weights before init_process_group"):
        asyncio.run(receiver.send_weights(iter([])))
