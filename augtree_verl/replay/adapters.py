"""LoRA adapters (PEFT), as verl builds them for ``actor_rollout_ref.model.lora_rank > 0``.

verl wraps the causal LM in PEFT's ``PeftModelForCausalLM`` (``get_peft_model``): each targeted linear layer
becomes a LoRA layer in place, inside the causal LM. A LoRA layer maps each token on its own (W x + B A x
scaled), so prompt reuse is exact for it as for any linear layer; the replay runs the causal LM inside the
wrapper (``causal_lm``), its decoder and its family's forward, with the adapters in place. LoRA dropout draws a
mask per call in training, which a prompt run once cannot reproduce for every row: refused by name, as are
PEFT methods other than LoRA (prompt tuning and its kin change the inputs).
"""

from __future__ import annotations

import torch

# What the refusal names as the way out of an adapter setting the replay does not run.
NO_DROPOUT = "set the adapter's lora_dropout to 0"


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM of ``model``: PEFT's base model (adapters in place) for a ``PeftModel``, else
    ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None and hasattr(model, "peft_config") else model


def adapter_problems(model: torch.nn.Module, *, training: bool) -> dict[str, str]:
    """feature -> setting, for each PEFT adapter of ``model`` the replay cannot run exactly (none for a model
    without adapters)."""
    problems: dict[str, str] = {}
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        kind = str(getattr(config, "peft_type", "?")).rsplit(".", 1)[-1]
        if kind != "LORA":
            problems[f"PEFT adapter {name!r} of type {kind} (only LoRA adapters are replayed)"] = f"peft_type={kind}"
        elif training and (getattr(config, "lora_dropout", 0.0) or 0.0) > 0:
            problems[f"LoRA dropout of adapter {name!r} ({NO_DROPOUT})"] = f"lora_dropout={config.lora_dropout}"
    return problems
