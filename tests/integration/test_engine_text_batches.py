"""Batches as verl's agent loop writes them: every sample carries ``multi_modal_inputs``, an empty dict for text."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu  # noqa: I001  (after the harness: it selects the CPU platform)

from augtree_verl.testing import harness as H
from tests.parity import RTOL, rel_err

pytestmark = pytest.mark.slow  # spawns process groups, Ray, verl engines or subprocesses

GROUPS = [(7, [3, 5, 2]), (4, [6, 1, 2])]  # 6 rows: micro-batches of 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory, single_process_group):
    engine, _ = H.build_engine("augtree", H.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2"))))
    return engine


def _logps(engine, batch):
    with engine.eval_mode():
        return H.response_logps(engine.infer_batch(batch, loss_function=None), batch)


def test_empty_multi_modal_inputs_are_a_text_batch(engine):
    rows = H.group_rows(GROUPS)
    # What AgentLoopWorkerTQ stores per text sample (agent_loop_tq.py: field["multi_modal_inputs"] = {}).
    agent_loop = H.rows_to_batch(rows, extra={"multi_modal_inputs": [{} for _ in rows]})
    want = _logps(engine, H.rows_to_batch(rows))
    got = _logps(engine, agent_loop)
    assert len(got) == len(rows)
    for row, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w) <= RTOL, f"row {row}"


def test_videos_are_refused_naming_the_row(engine):
    rows = H.group_rows(GROUPS)
    inputs = [{} for _ in rows]
    inputs[5] = {"pixel_values_videos": torch.zeros(4, 8), "video_grid_thw": torch.tensor([[1, 2, 2]])}
    batch = H.rows_to_batch(rows, extra={"multi_modal_inputs": inputs})
    with pytest.raises(
        ValueError,
        match=r"micro-batch 2 row 1 \(uid 'group-1'\): multi_modal_inputs with pixel_values_videos, video_grid_thw; "
        r"the augtree engine replays images .*strategy=fsdp2",
    ):
        _logps(engine, batch)


def test_images_on_a_text_model_are_refused_naming_the_tree(engine):
    """Images (tests/integration/test_engine_images.py) run on the vision-language models of ``replay.vlm.VLMS``
    only."""
    rows = H.group_rows(GROUPS)
    inputs = [{} for _ in rows]
    inputs[3] = {"pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    batch = H.rows_to_batch(rows, extra={"multi_modal_inputs": inputs}, mrope=True)
    assert tu.get(batch, "uid")[3] == "group-1"
    with pytest.raises(ValueError, match=r"\(uid 'group-1', batch rows \[3\]\) has images, but the model is not a"):
        _logps(engine, batch)


def test_mrope_positions_other_than_text_positions_are_refused_naming_the_row(engine):
    """A vision-language model's text-only rows carry [4, L] positions 0..L-1 on every axis (taken as they are);
    positions that say otherwise (an image's grid on the M-RoPE axes) are refused, naming the row."""
    rows = H.group_rows(GROUPS)
    batch = H.rows_to_batch(rows, mrope=True)
    want = _logps(engine, H.rows_to_batch(rows))
    for row, (g, w) in enumerate(zip(_logps(engine, batch), want)):
        assert rel_err(g, w) <= RTOL, f"row {row}"
    positions = [p.clone() for p in batch["position_ids"].unbind()]
    positions[4][2, 3:] += 2  # the height axis after an image of one token
    batch["position_ids"] = torch.nested.as_nested_tensor(positions, layout=torch.jagged)
    with pytest.raises(
        ValueError, match=r"micro-batch 2 row 0 \(uid 'group-1'\): position_ids must be 0..4 .*\[4, L\]"
    ):
        _logps(engine, batch)


def test_fused_kernels_are_refused_at_build_by_name(tmp_path):
    path = H.save_tiny_qwen2(str(tmp_path / "tiny-qwen2"))
    with pytest.raises(ValueError, match=r"use_fused_kernels=True.*use_fused_kernels=False.*strategy=fsdp2"):
        H.build_engine("augtree", path, model_settings={"use_fused_kernels": True})


def test_fused_kernels_in_a_batch_are_refused(engine):
    batch = H.rows_to_batch(H.group_rows(GROUPS))
    tu.assign_non_tensor(batch, use_fused_kernels=True)
    with pytest.raises(ValueError, match=r"does not support use_fused_kernels=True"):
        _logps(engine, batch)
