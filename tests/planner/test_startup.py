"""The run's profile at start-up (``planner.startup``): the user's file, the cache, or a calibration here."""

import dataclasses
import json

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config

from augtree_verl.planner import ClusterProfile
from augtree_verl.planner.startup import cache_file, startup_profile
from augtree_verl.testing import harness

TINY = Qwen2Config(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)
BASE = dataclasses.replace(
    ClusterProfile.default().with_model(TINY), dtype_bytes=4, activation_checkpointing=False, ranks_per_node=2
)
CPU = torch.device("cpu")


def test_calibrates_once_then_reads_the_cache(tmp_path):
    first = startup_profile(BASE, user_file=None, device=CPU, cache_dir=tmp_path)
    path = cache_file(BASE, CPU, 1, tmp_path)
    assert first.source.startswith("calibrated now") and str(path) in first.source
    assert first.profile.flops_per_s != BASE.flops_per_s and first.profile.num_layers == 2
    again = startup_profile(BASE, user_file=None, device=CPU, cache_dir=tmp_path)
    assert again.profile == first.profile == ClusterProfile.load(path) and again.source == f"cache file {path}"


def test_the_cache_key_is_model_shape_dtype_checkpointing_device_world_and_cp(tmp_path):
    path = cache_file(BASE, CPU, 1, tmp_path)
    others = [
        cache_file(BASE, CPU, 2, tmp_path),
        cache_file(dataclasses.replace(BASE, num_layers=3), CPU, 1, tmp_path),
        cache_file(dataclasses.replace(BASE, dtype_bytes=2), CPU, 1, tmp_path),
        cache_file(dataclasses.replace(BASE, activation_checkpointing=True), CPU, 1, tmp_path),
        cache_file(dataclasses.replace(BASE, ranks_per_node=8), CPU, 1, tmp_path),
        cache_file(BASE, CPU, 1, tmp_path, context_parallel=False),
    ]
    assert path not in others and len(set(others)) == len(others)
    # hardware figures are not part of the key: they are what the file holds
    assert cache_file(dataclasses.replace(BASE, flops_per_s=1.0), CPU, 1, tmp_path) == path


def test_a_run_without_cp_reads_a_file_with_cp_costs_but_not_the_other_way(tmp_path):
    with_cp, without = (cache_file(BASE, CPU, 1, tmp_path, context_parallel=cp) for cp in (True, False))
    tmp_path.mkdir(parents=True, exist_ok=True)
    dataclasses.replace(BASE, flops_per_s=1.25e12).save(with_cp)
    run = startup_profile(BASE, user_file=None, device=CPU, cache_dir=tmp_path, context_parallel=False)
    assert run.profile.flops_per_s == 1.25e12 and run.source == f"cache file {with_cp}" and not without.exists()
    with_cp.unlink()
    dataclasses.replace(BASE, flops_per_s=2.5e12).save(without)
    run = startup_profile(BASE, user_file=None, device=CPU, cache_dir=tmp_path)
    assert run.source.startswith("calibrated now") and str(with_cp) in run.source
    assert ClusterProfile.load(without).flops_per_s == 2.5e12  # the other kind's file is left as it was


def test_a_cache_file_of_another_model_is_calibrated_over(tmp_path):
    path = cache_file(BASE, CPU, 1, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dataclasses.replace(BASE, vocab_size=999).save(path)  # what a hand-edited or colliding file could hold
    run = startup_profile(BASE, user_file=None, device=CPU, cache_dir=tmp_path)
    assert run.source.startswith("calibrated now") and ClusterProfile.load(path).vocab_size == 256


def test_the_users_file_is_taken_as_it_is(tmp_path):
    mine = tmp_path / "mine.json"
    dataclasses.replace(BASE, flops_per_s=1.25e12).save(mine)
    run = startup_profile(BASE, user_file=str(mine), device=CPU, cache_dir=tmp_path / "cache")
    assert run.profile.flops_per_s == 1.25e12 and run.source == f"the user's file {mine}"
    assert not (tmp_path / "cache").exists()  # nothing calibrated, nothing cached


def test_a_users_file_for_another_model_or_unreadable_is_refused_by_name(tmp_path):
    other = tmp_path / "other.json"
    ClusterProfile.default().save(other)  # a Qwen2.5-7B shape in bf16
    with pytest.raises(ValueError, match=r"planner_profile=.*other model: num_layers=28 \(this run: 2\)"):
        startup_profile(BASE, user_file=str(other), device=CPU)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"flops_per_s": 1.0}))
    with pytest.raises(ValueError, match="planner_profile=.*broken.json.* cannot be read as a ClusterProfile"):
        startup_profile(BASE, user_file=str(broken), device=CPU)


def _two_ranks(rank, port, cache_dirs, other, results):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run = startup_profile(BASE, user_file=None, device=CPU, cache_dir=cache_dirs[rank])
        results[rank] = (run.profile.to_dict(), run.source)
        try:
            startup_profile(BASE, user_file=other, device=CPU, cache_dir=cache_dirs[rank])
        except ValueError as err:
            results[rank + 2] = str(err)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank_zero_decides_for_every_rank(tmp_path):
    """Rank 1's node has no cache: it follows rank 0 (which has one) instead of calibrating alone (a hang);
    a user's file rank 0 refuses raises on both ranks."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    cached = dataclasses.replace(BASE, flops_per_s=3.0e11, p2p_bytes_per_s=2.0e9)
    path = cache_file(BASE, CPU, 2, dirs[0])
    path.parent.mkdir(parents=True)
    cached.save(path)
    other = tmp_path / "other.json"
    ClusterProfile.default().save(other)
    with mp.Manager() as manager:
        results = manager.dict()
        harness.start_ranks(_two_ranks, (harness.free_port(), dirs, str(other), results), 2)
        results = dict(results)
    assert results[0] == results[1] == (cached.to_dict(), f"cache file {path}")
    assert all("was made for another model" in results[rank] for rank in (2, 3))
