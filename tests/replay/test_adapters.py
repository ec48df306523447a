"""LoRA adapters (``replay.adapters``): a PEFT LoRA model replays exactly, adapters in place (its gradients are the
flattened baseline's), and what it cannot replay exactly is refused by name (LoRA dropout in training, PEFT methods
other than LoRA)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

from augtree_verl import StepPlan, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.model_check import check_model
from tests.parity import assert_grads_match, assert_logps_match, grads, random_trees, tiny_model


def _lora(dropout: float = 0.0, target_modules="all-linear"):
    model = get_peft_model(
        tiny_model(),
        LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=dropout, target_modules=target_modules
        ),
    )
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A's gradient zero: give it weight
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.train()


def _loss(t, i, logp):
    return -(logp * (i - 1.5)).mean() + 0.05 * (logp**2).sum()


@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_replays_exactly(target_modules):
    model = _lora(target_modules=target_modules)
    check_model(model)
    trees = random_trees([9, 3], [[4, 6, 2], [5]])
    got = replay(model, StepPlan.build(trees, micro_batch_tokens=8), per_response(_loss))
    got_grads = grads(model)
    assert any("lora_A" in n for n in got_grads) and all("lora_" in n for n in got_grads)  # only adapters train
    model.zero_grad(set_to_none=True)
    want = flattened_replay(model, trees, _loss)
    assert_logps_match(got, want)
    assert_grads_match(got_grads, grads(model))


def test_lora_dropout_is_refused_in_training_by_name():
    model = _lora(dropout=0.05)
    with pytest.raises(ValueError, match=r"LoRA dropout of adapter 'default'.*lora_dropout=0.05.*strategy=fsdp2"):
        check_model(model)
    check_model(model, training=False)  # forward only: dropout is inactive


def test_other_peft_methods_are_refused_by_name():
    model = get_peft_model(tiny_model(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"PEFT adapter 'default' of type PROMPT_TUNING"):
        check_model(model)
