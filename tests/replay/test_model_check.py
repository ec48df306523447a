"""Refusals at build and the start-up exactness probe (``replay.model_check``) on the family matrix.

Every ``REFUSED`` family is refused by name (model type, layer, feature, and the stock-engine setting) from
its config and modules alone, before any model call; every ``PARITY`` family passes the probe; and the
probe refuses a replay that scores ``lm_head(h)`` instead of the family's own logits (the silent error
of Granite, Cohere and Gemma before the replay ran the family's forward tail).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from augtree_verl.replay import calls as calls_module
from augtree_verl.replay import run as replay_run
from augtree_verl.replay.memory import ReplayMemory
from augtree_verl.replay.model_check import (
    PROBE_PROMPT,
    PROBE_RESPONSES,
    PROBE_TOLERANCE,
    STOCK_ENGINE,
    check_model,
    length_thresholds,
    probe_exactness,
    probe_lengths,
)
from tests.families import PARITY, REFUSED, family_model


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name_before_any_call(name):
    model = family_model(name)
    called = []
    model.register_forward_pre_hook(lambda *_: called.append(1))
    for module in model.modules():
        module.register_forward_pre_hook(lambda *_: called.append(1))
    with pytest.raises(ValueError, match=REFUSED[name][3]) as error:
        check_model(model)
    assert STOCK_ENGINE in str(error.value) and "strategy=fsdp2" in str(error.value)
    assert not called, "the check must read config and modules only"


def test_attention_dropout_refused_in_training_only():
    model = family_model("qwen2")
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"'qwen2'.*layers 0-1: attention dropout \(attention_dropout=0.1\)"):
        check_model(model)
    check_model(model, training=False)  # forward only: dropout is inactive


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_families_pass_the_check_and_the_probe(name):
    model = family_model(name)
    check_model(model)
    result = probe_exactness(model, model, train=True)
    tol = PROBE_TOLERANCE[torch.float32]
    assert result.dtype == torch.float32 and result.logp_err <= tol.logp and result.grad_err <= tol.grad
    assert all(p.grad is None for p in model.parameters()), "the probe leaves no gradient behind"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_probe_passes_in_half_precision(dtype):
    for name in ("qwen2", "gemma3"):
        result = probe_exactness(*[family_model(name, dtype=dtype)] * 2, train=True)
        assert result.dtype == dtype


@pytest.mark.parametrize("name", ["granite", "cohere", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_refuses_a_skipped_logit_transform(name, dtype, monkeypatch):
    """The replay as it was: the LM head alone, the family's transform skipped."""
    monkeypatch.setattr(calls_module, "logits_head", lambda model: model.get_output_embeddings())
    model = family_model(name, dtype=dtype)
    with pytest.raises(ValueError, match=rf"exactness probe: model '{model.config.model_type}'.*log-prob error"):
        probe_exactness(model, model, train=True)


def test_probe_refuses_a_layer_outside_the_attention_hook():
    model = family_model("llama")
    attention = model.model.layers[1].self_attn
    attention.forward = lambda hidden_states, **kwargs: (torch.zeros_like(hidden_states), None)
    with pytest.raises(ValueError, match=r"'llama'.*layer 1: attention that does not run through .*LlamaDecoderLayer"):
        probe_exactness(model, model, train=True)


def test_refusal_names_layer_runs():
    """Layer 0 is the model's Gated DeltaNet (replayed with its state); the config's other linear layers have
    no such module."""
    model = family_model("qwen3-next")
    lin, sliding = "linear_attention", "sliding_attention"
    model.config.layer_types = [lin, lin, lin, sliding, lin, sliding, lin, lin]
    model.config.num_hidden_layers = 8
    with pytest.raises(ValueError, match=r"layers 1-2, 4, 6-7: linear attention outside .*; layers 3, 5: sliding"):
        check_model(model)


def test_probe_forward_only_and_existing_grads_kept():
    model = family_model("qwen3")
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    result = probe_exactness(model, model, train=False)
    assert math.isnan(result.grad_err) and result.logp_err <= PROBE_TOLERANCE[torch.float32].logp
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())
    result = probe_exactness(model, model, train=True)
    assert all(bool((p.grad == 3.0).all()) for p in model.parameters())


def test_probe_lengths_cross_each_threshold_and_reach_the_runs_rows():
    config = family_model("phi3-longrope").config  # longrope's original maximum: 12
    assert length_thresholds(config) == {"rope original_max_position_embeddings": 12}
    default = (PROBE_PROMPT, PROBE_RESPONSES)
    assert probe_lengths(config) == [default, (10, (2, 4))]  # rows of 12 and 14 tokens on one prompt
    assert probe_lengths(config, prompt_tokens=48, response_tokens=32) == [default, (10, (2, 4)), (48, (32, 5))]
    # the device holds rows of 40 tokens: the run's row scaled to them; a run that never reaches 12: not crossed
    assert probe_lengths(config, prompt_tokens=48, response_tokens=32, row_cap=40)[-1] == (24, (16, 5))
    assert probe_lengths(config, prompt_tokens=6, response_tokens=4) == [default, (6, (4, 4))]


def _rope_switching_at(model, tokens: int) -> None:
    """A fault no config declares: the rotary embedding doubles its positions in a call longer than ``tokens``."""
    rotary = model.model.rotary_emb
    forward = rotary.forward
    rotary.forward = lambda x, position_ids: forward(x, position_ids * (2 if position_ids.max() >= tokens else 1))


def test_probe_at_the_runs_lengths_refuses_a_fault_beyond_the_short_probe():
    model = family_model("llama")
    _rope_switching_at(model, 64)
    probe_exactness(model, model, train=True)  # the short probe's rows (24 tokens) never reach it
    with pytest.raises(ValueError, match=r"exactness probe: model 'llama'.*\(48, \(32, 5\)\)"):
        probe_exactness(model, model, train=True, prompt_tokens=48, response_tokens=32)


def test_probe_crosses_a_declared_threshold(monkeypatch):
    """Phi-3's longrope switches at 12 tokens, beyond the short probe's prompt: with the replay's rope pinning
    off, the probe's tree across 12 refuses the model."""
    model = family_model("phi3-longrope")
    result = probe_exactness(model, model, train=True)
    assert (10, (2, 4)) in result.trees
    monkeypatch.setattr(replay_run, "pinned", lambda model, length: contextlib.nullcontext())
    with pytest.raises(ValueError, match=r"exactness probe: model 'phi3'.*log-prob error"):
        probe_exactness(model, model, train=True)


def test_probe_rows_capped_to_the_budget():
    """A row's forward and backward, every position scored, costs ``ReplayMemory``'s per-token bytes: the probe's
    rows stop at the budget's worth (the run's 400 + 100 tokens scaled to 60)."""
    model = family_model("qwen2")
    memory = ReplayMemory.of(model.config, dtype=torch.float32, checkpointing=False, train=True, budget_bytes=0)
    per_token = memory.layer + memory.head + memory.saved
    result = probe_exactness(
        model, model, train=True, prompt_tokens=400, response_tokens=100, budget_bytes=60 * per_token
    )
    assert result.row_cap == 60 and result.trees[-1] == (48, (12, 5))
