"""Every causal-LM and image-text-to-text class the installed transformers registers, as a tiny random model, through
the engine's build checks (``replay.model_check``: ``check_model``, then the start-up probe, then what the engine reads
of the config after it: the planner's profile, the memory guard): each must replay exactly or be refused by name.
``tests/replay/test_family_sweep.py`` runs it; ``python -m tests.family_sweep --write docs/models.md`` writes the
table of docs/models.md.

A class's tiny model is its config class's defaults shrunk generically (``shrink``: widths, heads, layers, vocabulary,
experts, the lengths a family changes at; dropout off, so that the table shows what the family's layers do in training
without it; token ids inside the vocabulary), the few settings the generic shrink cannot get right per model type in
``OVERRIDES``, and the classes whose tiny model cannot be built here in ``SKIPPED`` with the reason. float32, CPU, one
process: the probe's flattened rows are the model's own forward, no verl engine is needed.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
import warnings

import torch
import transformers
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from augtree_verl.planner import ClusterProfile
from augtree_verl.replay.memory import STOCK_ENGINE, ReplayMemory
from augtree_verl.replay.model_check import check_model, probe_exactness

# Config sizes and their tiny values (a config's own value where smaller).
SIZES = {
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "ffn_hidden_size": 64,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 8,
    "kv_channels": 8,
    "attention_head_dim": 8,
    "rotary_dim": 8,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,  # unless the default's equals the query/key width (``shrink``)
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "vocab_size": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "d_head": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 8,
    "mamba_d_ssm": 64,
    # lengths at which a family changes (the probe crosses each: ``model_check.length_thresholds``) and positions
    "original_max_position_embeddings": 24,
    "sliding_window": 24,
    "attention_chunk_size": 24,
    "index_topk": 24,
    "keep_window_size": 24,
    "max_position_embeddings": 512,
    "n_positions": 512,
}
# Sizes some default configs leave None that their models need (their tiny value then).
FILLED = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
DROPOUT = re.compile(r"(dropout|_pdrop|dropout_prob|dropout_rate)$")
# Config keys a config's ``to_dict`` writes that its constructor does not take back (a sub-config keeps its
# ``model_type``, which says its class).
NOT_KWARGS = ("transformers_version", "architectures", "_name_or_path", "output_attentions")

# model type -> settings the generic shrink cannot derive (applied to the shrunk config dict; sub-configs by key)
OVERRIDES: dict[str, dict] = {
    "mamba2": dict(num_heads=8),  # hidden x expand = heads x head_dim
    "mistral4": dict(head_dim=16),  # rope on half of each head (partial_rotary_factor 0.5): qk_rope_head_dim x 2
    # attention: rope_theta is not kept by the config's dict; the router reads ffn_hidden_size as the model's width
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=32)),
    "dots1": dict(n_shared_experts=1),  # the default leaves it unset
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"])),  # the default leaves them unset
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16]),  # causal LM head; embeddings sum to hidden
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # the default leaves them unset
    # M-RoPE sections the defaults leave unset: the 4 frequency pairs of the shrunk head (32 / 4 heads)
    "qwen2_vl": dict(text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1]))),
    "qwen2_5_vl": dict(text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1]))),
    "chameleon": dict(vocabulary_map={"<image>": 4}),  # image token ids in the (tiny) vocabulary
    "emu3": dict(vocabulary_map={"<image>": 4}),
    # KV sharing: the shared layers read the last earlier layer of their type
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        intermediate_size=[64] * 4,
        activation_sparsity_pattern=[0.0] * 4,
    ),
}
# class name -> why its tiny model cannot be built (kept short: every other class is built and checked)
SKIPPED: dict[str, str] = {
    "FastVlmForConditionalGeneration": "its vision tower needs timm (not installed)",
    "Gemma3nForConditionalGeneration": "its vision tower needs timm (not installed)",
    "PerceptionLMForConditionalGeneration": "its vision tower needs timm (not installed)",
    "VisionEncoderDecoderModel": "any vision encoder with any text decoder: its config has no default to shrink",
    "Ernie4_5_VLMoeForConditionalGeneration": "its 3-D rope's sections fit no head narrower than the default's",
    "Gemma4AssistantForCausalLM": "a drafter for a Gemma 4 model's speculative decoding: no model on its own",
    "Gemma4UnifiedAssistantForCausalLM": "a drafter for a Gemma 4 model's speculative decoding: no model on its own",
    "Granite4VisionForConditionalGeneration": "its default config is incomplete (Llama text config, no deepstack map)",
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    cls: str
    model_type: str
    kind: str  # "causal-lm" or "image-text-to-text" (the auto mapping that registers the class)
    status: str  # "exact", "refused", "skipped", or "broken" (neither: a test failure)
    detail: str  # exact: the probe's errors; refused: the refusal; skipped: the reason; broken: the error
    seconds: float


def classes() -> list[tuple[str, str, str]]:
    """(class name, model type, kind) of every registered class, each class once (causal-LM first)."""
    seen: dict[str, tuple[str, str, str]] = {}
    for kind, mapping in (
        ("causal-lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("image-text-to-text", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
    ):
        for model_type, name in mapping.items():
            for cls in name if isinstance(name, tuple) else (name,):
                seen.setdefault(cls, (cls, model_type, kind))
    return sorted(seen.values())


def shrink(values: dict) -> dict:
    """A config dict with every size in ``SIZES`` shrunk, layers cut to one of each kind of ``layer_types`` (at
    least two), per-layer lists cut alike, dropout 0 and token ids inside the vocabulary; sub-configs likewise."""
    n = next((values[k] for k in LAYERS if isinstance(values.get(k), int) and values[k] > 0), None)
    keep: list[int] | None = None
    if n:
        kinds = values.get("layer_types")
        firsts = [kinds.index(k) for k in dict.fromkeys(kinds)] if isinstance(kinds, list) and len(kinds) == n else []
        keep = [i for i in (firsts if len(firsts) >= 2 else [0, 1]) if i < n]
    out = {}
    for key, value in values.items():
        if key in NOT_KWARGS:
            continue
        if isinstance(value, dict):
            out[key] = shrink(value)
        elif not isinstance(key, str) or isinstance(value, bool):
            out[key] = value
        elif keep is not None and key in LAYERS and isinstance(value, int):
            out[key] = len(keep)
        elif keep is not None and n > 2 and isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in keep]
        elif key in SIZES and isinstance(value, int):
            out[key] = min(value, SIZES[key])
        elif key in FILLED and value is None:
            out[key] = SIZES[key]
        elif DROPOUT.search(key) and isinstance(value, float):
            out[key] = 0.0
        elif key.endswith("token_id") and isinstance(value, int):
            out[key] = min(value, 3)
        else:
            out[key] = value
    qk = values.get("qk_head_dim") or (values.get("qk_nope_head_dim") or 0) + (values.get("qk_rope_head_dim") or 0)
    if isinstance(values.get("v_head_dim"), int) and values["v_head_dim"] == qk:  # keep MLA's widths equal
        out["v_head_dim"] = (out.get("qk_nope_head_dim") or 0) + (out.get("qk_rope_head_dim") or 0) or out["v_head_dim"]
    return out


def tiny_model(cls_name: str, model_type: str, seed: int = 0):
    """The class's tiny random model (float32, train mode) from its config class's shrunk defaults."""
    model_cls = getattr(transformers, cls_name)
    config_cls = model_cls.config_class
    values = shrink(config_cls().to_dict())
    values.pop("model_type", None)
    for key, value in OVERRIDES.get(model_type, {}).items():
        values[key] = (
            {**values[key], **value} if isinstance(value, dict) and isinstance(values.get(key), dict) else value
        )
    config = config_cls(**values)
    for implementation in ("sdpa", "eager"):  # eager where a part has no SDPA (e.g. a Q-Former)
        config._attn_implementation = implementation
        torch.manual_seed(seed)
        try:
            return model_cls(config).float().train()
        except ValueError as error:
            if implementation == "eager" or "scaled_dot_product_attention" not in str(error):
                raise
    raise AssertionError("unreachable")


def run(cls_name: str, model_type: str, kind: str) -> Outcome:
    """One class through ``check_model`` and the probe (training)."""
    start = time.perf_counter()
    outcome = lambda status, detail: Outcome(cls_name, model_type, kind, status, detail, time.perf_counter() - start)
    if cls_name in SKIPPED:
        return outcome("skipped", SKIPPED[cls_name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = tiny_model(cls_name, model_type)
        except Exception as error:  # noqa: BLE001 - a class that cannot be built is reported, not raised
            return outcome("broken", f"build: {type(error).__name__}: {error}")
        try:
            check_model(model)
            probe = probe_exactness(model, model, train=True)
        except ValueError as error:
            ours = STOCK_ENGINE in str(error)  # every refusal names the way out; other ValueErrors are crashes
            return outcome("refused" if ours else "broken", str(error) if ours else f"ValueError: {error}")
        except Exception as error:  # noqa: BLE001
            return outcome("broken", f"{type(error).__name__}: {error}")
        try:  # what the engine reads of the config after the probe: the planner's profile, the memory guard
            ClusterProfile.default().with_model(model.config)
            ReplayMemory.of(model.config, dtype=probe.dtype, checkpointing=True, train=True, budget_bytes=1)
        except Exception as error:  # noqa: BLE001
            return outcome("broken", f"after the probe: {type(error).__name__}: {error}")
    return outcome("exact", f"log-prob error {probe.logp_err:.1e}, gradient error {probe.grad_err:.1e}")


def sweep(names: list[str] | None = None) -> list[Outcome]:
    """``run`` on every registered class (``names``: only those classes or model types), transformers quiet."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return [run(*c) for c in classes() if names is None or c[0] in names or c[1] in names]
    finally:
        transformers.logging.set_verbosity(verbosity)


def reason(detail: str) -> str:
    """A refusal's features, short: what ``model_check.refusal`` lists between the model and "is/are not", or the
    probe's measured errors."""
    found = re.search(r"exactly: (.*) (?:is|are) not implemented by the replay", detail)
    if found:
        return found.group(1)
    return detail.split(" against its own forward")[0]


COMMAND = "python -m tests.family_sweep --write docs/models.md"
HEADER = """# Model families

Every causal-LM and image-text-to-text class that transformers {version} registers
(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), as a tiny random model through
the engine's build checks (`replay.model_check`: `check_model`, then the start-up exactness probe; float32, CPU):

- **exact**: prompt reuse gives the model's own log-probs and gradients on the probe's trees (the short tree and one
  across each length the config says the family changes at);
- **refused**: the engine refuses the model at build, naming the features below (and the way out,
  `actor_rollout_ref.actor.strategy=fsdp2`); training with dropout is refused too (the tiny models here have none);
- **skipped**: no tiny model of the class can be built here (the reason).

The tiny models are the config classes' defaults, shrunk (`tests/family_sweep.py`); a family's real checkpoints may
set features its defaults do not (a sliding window, a longrope), which the engine checks on the real config at
build. The slow test `tests/replay/test_family_sweep.py` runs this sweep and fails on any class that is neither
exact nor refused by name, and where this table is not the sweep's. Regenerate it with `{command}`.

{counts}

"""


def table(outcomes: list[Outcome]) -> str:
    lines = ["| family (model type) | class | registered as | status |", "|---|---|---|---|"]
    for o in sorted(outcomes, key=lambda o: (o.model_type, o.cls)):
        status = {"refused": f"refused: {reason(o.detail)}", "skipped": f"skipped: {o.detail}"}.get(o.status, o.status)
        lines.append(f"| {o.model_type} | {o.cls} | {o.kind} | {status.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def document(outcomes: list[Outcome]) -> str:
    counts = ", ".join(f"{sum(o.status == s for o in outcomes)} {s}" for s in ("exact", "refused", "skipped", "broken"))
    header = HEADER.format(
        version=transformers.__version__, command=COMMAND, counts=f"{len(outcomes)} classes: {counts}."
    )
    return header + table(outcomes)


def main(argv: list[str]) -> None:
    """``--write PATH``: the table's document; other arguments: only those classes or model types."""
    torch.set_num_threads(1)
    path = argv[argv.index("--write") + 1] if "--write" in argv else None
    names = [a for a in argv if a != "--write" and a != path] or None
    results = sweep(names)
    for o in results:
        print(f"{o.status:8s} {o.seconds:6.2f}s {o.cls:45s} {o.detail[:200]}")
    print(document(results).split("\n\n")[-2], f"{sum(o.seconds for o in results):.1f} s")
    if path is not None:
        with open(path, "w") as out:
            out.write(document(results))


if __name__ == "__main__":
    main(sys.argv[1:])
