import dataclasses
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.calibrate import MIN_OVERHEAD_S

CALIBRATE_SECONDS = 20      # "in seconds" on a shared 2-core CPU, with generous slack
COMM_FIELDS = ("p2p_bytes_per_s", "collective_bytes_per_s")
COMPUTE_FIELDS = ("flops_per_s", "attention_flops_per_s")
OVERHEAD_FIELDS = ("call_overhead_s", "slot_overhead_s")


def test_default_is_an_h100_node_with_a_qwen7b_shape():
    p = ClusterProfile.default()
    assert p.ranks_per_node == 8 and p.num_layers == 28 and p.num_kv_heads == 4 and p.head_dim == 128
    assert 300e12 < p.flops_per_s < 989e12


@pytest.mark.parametrize("field, value", [
    ("flops_per_s", 0), ("p2p_bytes_per_s", -1.0), ("launch_latency_s", float("nan")),
    ("attention_flops_per_s", -2.0), ("call_overhead_s", 0.0), ("slot_overhead_s", -1e-3),
    ("memory_per_rank_bytes", float("inf")), ("num_layers", 0), ("head_dim", 2.0), ("ranks_per_node", True),
    ("num_kv_heads", 3), ("min_parallel_efficiency", 1.5), ("activation_checkpointing", 1),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"ClusterProfile.{field}"):
        dataclasses.replace(ClusterProfile.default(), **{field: value})


def test_save_load_roundtrip(tmp_path):
    p = dataclasses.replace(ClusterProfile.default(), flops_per_s=1.25e14, activation_checkpointing=False)
    p.save(tmp_path / "profile.json")
    assert ClusterProfile.load(tmp_path / "profile.json") == p


def test_from_dict_rejects_unknown_fields():
    d = ClusterProfile.default().to_dict() | {"nvlink_gen": 4}
    with pytest.raises(ValueError, match=r"no field\(s\) \['nvlink_gen'\]"):
        ClusterProfile.from_dict(d)


def test_from_dict_names_the_fields_an_earlier_version_did_not_save():
    d = ClusterProfile.default().to_dict()
    del d["ring_hop_s"], d["all_to_all_s"]
    with pytest.raises(ValueError, match=r"needs the field\(s\) \['all_to_all_s', 'ring_hop_s'\]"):
        ClusterProfile.from_dict(d)


def test_with_model_reads_a_hugging_face_config():
    cfg = Qwen2Config(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1000)
    p = ClusterProfile.default().with_model(cfg)
    assert (p.num_layers, p.num_heads, p.num_kv_heads, p.head_dim, p.hidden_size, p.intermediate_size,
            p.vocab_size) == (3, 8, 2, 32, 256, 512, 1000)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_calibrate_without_process_group_measures_compute_and_keeps_comm():
    base = ClusterProfile.default()
    start = time.perf_counter()
    p = base.calibrate()
    assert time.perf_counter() - start < CALIBRATE_SECONDS
    assert all(getattr(p, f) != getattr(base, f) for f in COMPUTE_FIELDS)
    assert 1e8 < p.flops_per_s < 1e13 and 1e8 < p.attention_flops_per_s < 1e13
    assert all(getattr(p, f) == getattr(base, f)    # without a model, the replay's overheads stay too
               for f in COMM_FIELDS + OVERHEAD_FIELDS + ("launch_latency_s", "memory_per_rank_bytes"))
    assert p.num_layers == base.num_layers


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_calibrate_with_a_model_measures_the_replays_call_and_slot_overheads():
    """The fixed costs come from replaying tiny trees on the model itself; its gradients are left untouched."""
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=256)
    model = Qwen2ForCausalLM(cfg).train()
    grad = model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    base = ClusterProfile.default().with_model(cfg)
    p = base.calibrate(model=model)
    for f in OVERHEAD_FIELDS:   # measured (the slot's rest may come out at the floor on a loaded machine)
        assert getattr(p, f) != getattr(base, f) and MIN_OVERHEAD_S <= getattr(p, f) < 1.0, (f, getattr(p, f))
    assert model.lm_head.weight.grad is grad and all(
        param.grad is None for name, param in model.named_parameters() if name != "lm_head.weight")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calibrate_worker(rank, world, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        start = time.perf_counter()
        profile = ClusterProfile.default().calibrate()
        results[rank] = (profile.to_dict(), time.perf_counter() - start)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_on_gloo_agrees_across_ranks():
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_calibrate_worker, args=(world, _free_port(), results), nprocs=world, join=True)
        results = dict(results)
    (p0, t0), (p1, t1) = results[0], results[1]
    assert p0 == p1
    assert max(t0, t1) < CALIBRATE_SECONDS
    base = ClusterProfile.default()
    for f in COMM_FIELDS:
        assert p0[f] != getattr(base, f) and 1e6 < p0[f] < 1e12
    assert p0["launch_latency_s"] != base.launch_latency_s and 0 < p0["launch_latency_s"] < 1e-1
