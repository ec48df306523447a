"""The family matrix against verl's stock engine: each ``tests.families.PARITY`` family picked here trains two
optimizer steps on 2 gloo ranks with the augtree engine and with verl's stock fsdp2 engine, and must give the same
log-probs, entropies, losses, gradient norms and weights (the families whose logits the family's own forward
transforms, MoEs, multi-head latent attention, whose value width differs from the query/key width, and a hybrid's
context-parallel plans); a refused
family is refused when the engine is built, and so is a replay that skipped a family's logit transform (the start-up
exactness probe)."""

from __future__ import annotations

import warnings

import pytest
import torch

from augtree_verl.integration.vlm import verl_reads_vision_output_as_tensor, vision_output_as_tensor
from augtree_verl.replay import calls as calls_module
from augtree_verl.testing import harness as H
from tests.families import family_model
from tests.integration.test_engine_cp import PLANS_DEGREE_2
from tests.integration.test_engine_cp import _rank_main as cp_rank_main
from tests.integration.test_engine_parity_dp2 import _rank_main
from tests.integration.test_engine_streaming import compare_at_micro_batch_setting

pytestmark = pytest.mark.slow  # spawns process groups and builds verl engines

WORLD = 2
# float32: the probe's rounding error was at most 8.8e-7 over 11 families and 3 seeds (replay/model_check.py)
PROBE_BOUND = 1e-4
GROUPS = [(9, [3, 5, 4, 2]), (4, [6, 2, 3, 1]), (6, [4, 2, 3, 1])]  # rows dealt round-robin: 6 a rank
FAMILIES = ["granite", "cohere", "gemma2", "qwen3-moe", "qwen3.5-moe", "deepseek-v3"]


def _save(name: str, directory) -> str:
    family_model(name).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_stock_engine(name, tmp_path):
    H.spawn(_rank_main, (H.free_port(), _save(name, tmp_path / name), GROUPS, PROBE_BOUND), nprocs=WORLD, timeout_s=540)


# Vision-language checkpoints, text-only rows in verl's batch format for them (M-RoPE position ids [4, L], packed
# [4, 1, nnz] under remove-padding), with weight decay: verl's text-only forward gives the vision tower zero
# gradients, which AdamW's decay then applies, so a replay that left them absent would leave the tower behind.
VLM_WEIGHT_DECAY = 0.1
# verl's use_remove_padding per family: False for the hybrids (as above) and for Qwen2(.5)-VL, whose attention verl
# patches for remove-padding with a flash-attention-only forward (no flash attention on CPU).
VLM_REMOVE_PADDING = {
    "qwen2-vl": False,
    "qwen2.5-vl": False,
    "qwen3-vl": True,
    "qwen3-vl-moe": True,
    "qwen3.5-vl": False,
    "qwen3.5-moe-vl": False,
}


def _vision_output_as_tensor(engine) -> None:
    """verl 0.9.1's dummy vision forward for Qwen2(.5)-VL takes ``.mean()`` of the tower's output, which transformers 5
    returns as an object: the stock engine cannot train a text-only batch (AttributeError). Its tower here returns
    the merged embeddings, as the augtree engine's does (``replay.vlm.vision_output_as_tensor``)."""
    if verl_reads_vision_output_as_tensor(engine.module):
        vision_output_as_tensor(engine.module)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", sorted(VLM_REMOVE_PADDING))
def test_vision_language_text_rows_match_stock_engine(name, checkpointing, tmp_path):
    """Both engines with verl's gradient checkpointing on or off (on: the text layers and the vision blocks)."""
    _vision_language_rows_match(name, tmp_path, gradient_checkpointing=checkpointing)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["qwen3-vl", "qwen3.5-vl"])
def test_vision_language_lora_matches_stock_engine(name, tmp_path):
    """verl's LoRA on all linear layers, the vision tower's included: those adapters get the dummy forward's zero
    gradients, and weight decay, in both engines."""
    _vision_language_rows_match(name, tmp_path, lora=dict(lora_rank=4, lora_alpha=8, target_modules="all-linear"))


def _vision_language_rows_match(name: str, tmp_path, lora: dict | None = None, **build) -> None:
    """The dp2 family run on a vision-language checkpoint's text-only rows (M-RoPE positions, ``VLM_WEIGHT_DECAY``,
    verl's use_remove_padding for it); ``lora``, ``build``: more model settings and ``build_engine`` settings."""
    settings = {"use_remove_padding": VLM_REMOVE_PADDING[name], **(lora or {})}
    build = dict(build, weight_decay=VLM_WEIGHT_DECAY, model_settings=settings)
    H.spawn(
        _rank_main,
        (H.free_port(), _save(name, tmp_path / name), GROUPS, PROBE_BOUND, True, build, _vision_output_as_tensor),
        nprocs=WORLD,
        timeout_s=540,
    )


@pytest.fixture(scope="module")
def one_rank(single_process_group):
    H.use_cpu_platform()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting,checkpointing", [("rows-1", True), ("dynamic", False)])
def test_hybrid_micro_batch_settings_match_stock_engine(one_rank, tmp_path, setting, checkpointing):
    """A hybrid (Qwen3.5: Gated DeltaNet state) under verl's other micro-batch settings (rows-2: the dp2 family
    run), world 1, 3 steps: the streamed schedule's check."""
    compare_at_micro_batch_setting(_save("qwen3.5", tmp_path / "qwen3.5"), setting, checkpointing)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-vl"])
def test_hybrid_cp_plans_run_context_parallel(tmp_path, name):
    """World 2, one CP group of both ranks, plans of degree 2 (MoveQ, TreeMoveKV, ring): a hybrid's run context-
    parallel on both ranks (its Gated DeltaNet state through the scan, ``cp.state_scan``; nothing demoted, bytes
    moved), and the step still matches the stock engine (``test_engine_cp``'s rank); Qwen3.5 as it ships too
    (vision tower, text-only rows with M-RoPE positions)."""
    path = _save(name, tmp_path / name)
    mrope = name.endswith("-vl")
    H.spawn(
        cp_rank_main,
        (WORLD, H.free_port(), path, [1, 2], PLANS_DEGREE_2, 2, "token-mean", 0.0, 0, None, mrope),
        nprocs=WORLD,
        timeout_s=360,
    )


def _build_with_remove_padding(rank: int, port: int, path: str) -> None:
    H.use_cpu_platform()
    H.init_process_group(rank=rank, world_size=1, port=port)
    engine, _ = H.build_engine("augtree", path, model_settings={"use_remove_padding": True})
    assert engine.exactness_probe.grad_err <= PROBE_BOUND
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(300)
def test_qwen2_5_vl_with_remove_padding_builds(tmp_path):
    """verl's use_remove_padding patches Qwen2.5-VL's attention class with a flash-attention-only forward outside
    transformers' attention interface; the engine gives its own model transformers' forward back
    (``replay.vlm.prepare_for_replay``): the build's checks and its exactness probe pass. In a process of its own:
    verl's patches of the class stay in the process that built the engine."""
    path = _save("qwen2.5-vl", tmp_path / "qwen2.5-vl")
    H.spawn(_build_with_remove_padding, (H.free_port(), path), nprocs=1, timeout_s=240)


@pytest.mark.timeout(120)
def test_unimplemented_linear_attention_refused_at_build(one_rank, tmp_path):
    with pytest.raises(ValueError, match=r"'olmo_hybrid'.*layer 0: linear attention outside .*strategy=fsdp2"):
        H.build_engine("augtree", _save("olmo-hybrid", tmp_path / "olmo-hybrid"))


@pytest.mark.timeout(120)
def test_skipped_logit_transform_refused_at_build(one_rank, tmp_path, monkeypatch):
    path = _save("granite", tmp_path / "granite")
    monkeypatch.setattr(calls_module, "logits_head", lambda model: model.get_output_embeddings())
    with pytest.raises(ValueError, match=r"exactness probe: model 'granite'.*log-prob error .*strategy=fsdp2"):
        H.build_engine("augtree", path)


@pytest.mark.timeout(120)
def test_forward_only_engine_probes_log_probs(one_rank, tmp_path):
    """A reference-policy engine (forward only) probes the log-probs alone, in eval mode."""
    engine, _ = H.build_engine("augtree", _save("gemma3", tmp_path / "gemma3"), forward_only=True)
    probe = engine.exactness_probe
    assert probe.logp_err <= 1e-4 and probe.grad_err != probe.grad_err  # nan: no backward


@pytest.mark.timeout(120)
def test_the_fsdp_root_returns_no_view_of_the_logits(one_rank, tmp_path):
    """The engine's start-up probe trains through the FSDP2 root (its decoder and logits calls): FSDP warns
    when the root returns a view (an in-place op on it would skip its pre-backward hook); none is returned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        H.build_engine("augtree", _save("granite", tmp_path / "granite"))
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]


@pytest.mark.timeout(120)
def test_bf16_mixed_precision_probe(one_rank, tmp_path, monkeypatch):
    """FSDP2 mixed precision (float32 storage, bf16 compute): the probe measures in, and is held to, bf16."""
    monkeypatch.setitem(H.FP32, "param_dtype", "bf16")
    engine, _ = H.build_engine("augtree", _save("granite", tmp_path / "granite"))
    assert engine.exactness_probe.dtype == torch.bfloat16
