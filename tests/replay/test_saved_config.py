"""A checkpoint saved after a replay carries nothing of ours: its config.json is the model's own (the replay
routes attention through "augtree" for the life of the model, and keeps the original implementation off
the config), and it loads back with the original attention implementation."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from augtree_verl import StepPlan, per_response, replay
from tests.parity import random_trees, tiny_model


def test_saved_config_has_no_key_of_ours(tmp_path):
    model = tiny_model("qwen2-gqa")
    before = model.config.to_dict()
    replay(model, StepPlan.build(random_trees([5], [[3, 2]])), per_response(lambda t, i, lp: lp.sum()))
    assert model.config._attn_implementation == "augtree"
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    ours = [k for k, v in saved.items() if "augtree" in k or "augtree" in json.dumps(v)]
    assert not ours, f"config.json carries {ours}"
    assert model.config.to_dict().keys() == before.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "sdpa"
    ids = torch.arange(6)[None]
    with torch.no_grad():  # the routed model, called without a replay context, still runs its own attention
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
