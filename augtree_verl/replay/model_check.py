"""What the replay refuses, by name, before any work, and the start-up exactness probe.

``check_model(model)`` reads the model's config, classes and modules (no model call): every layer type or feature
the replay does not implement raises one ``ValueError`` naming the model type, the layers, the features with their
settings, and the setting that trains the model on verl's stock engine instead (``STOCK_ENGINE``). Refused:

- what the replay cannot call: a forward without ``logits_to_keep``, a ``get_decoder()`` that returns the model
  itself (Llama 4's text model), a multimodal model (a vision, audio or other non-text sub-config, or modules of
  the base model around the text decoder) other than the vision-language classes whose text decoder, LM head and
  vision tower the replay runs, on text-only rows and rows with images (``vlm.VLMS``: their vision tower is the one
  module allowed around it);
- attention the replay's hook does not compute: attention modules that do not dispatch through transformers'
  attention interface (Falcon, MPT, Bloom's ALiBi...), layer types other than full attention and the Gated
  DeltaNet layers of ``linear_state`` (sliding windows, chunked attention, Mamba...), a sliding window on every
  layer, attention logit soft-capping, attention sinks, per-query key selection (a DeepSeek sparse-attention
  indexer, ``index_topk``; Doge's dynamic mask, ``keep_window_size``), bidirectional or cross-attention, K/V
  shared across layers (Gemma 3n / 4 ``num_kv_shared_layers``), layers run in cycles (HRM);
- what no schedule reproduces: dropout in training (attention dropout, ``nn.Dropout`` modules), a rope whose
  frequencies depend on the engine's earlier calls (``dynamic``: ``rope.stateful_ropes``). A rope that depends
  on the call's length by steps (``longrope``) is replayed exactly (``replay.rope``).

``probe_exactness(...)`` runs the user's own model through prompt reuse and through the model's ordinary forward
on the flattened rows (forward and backward), on a short tree, on a tree across each length at which the config
says the family changes (``length_thresholds``: the rope's original maximum, sliding windows, chunk and top-k
sizes) and on a tree of the run's own longest row (``probe_lengths``), compares log-probs and gradients, and
refuses beyond ``PROBE_TOLERANCE`` of the compute dtype with the measured errors. It catches what no list can: a
family that changes logits or hidden states in a way the replay does not reproduce, at the lengths the run
reaches. The engine runs both at build (``integration/engine.py``); the attention hook keeps its per-call refusal
of the same attention features for direct ``replay`` callers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import time

import torch
from transformers import PretrainedConfig

from augtree_verl.groups import Tree
from augtree_verl.model_shape import ModelShape, text_config
from augtree_verl.replay.adapters import adapter_problems, causal_lm
from augtree_verl.replay.attention import PrefillContext, original_attention, use_augtree_attention
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.linear_state import STATE_MODULES, linear_attention_modules
from augtree_verl.replay.memory import STOCK_ENGINE, ReplayMemory
from augtree_verl.replay.rope import RopeRegimes, rope_parameters, stateful_ropes
from augtree_verl.replay.run import per_response, replay
from augtree_verl.replay.step_plan import StepPlan
from augtree_verl.replay.vlm import VLMS, is_vlm

# ``config.layer_types`` entries and what the replay would need to implement for them.
LAYER_TYPE_FEATURES = {
    "sliding_attention": "sliding-window attention",
    "linear_attention": f"linear attention outside {', '.join(sorted(STATE_MODULES))}",
    "chunked_attention": "chunked attention",
}


def refusal(model_type: str, problems: dict[str, tuple[list, str]]) -> str:
    """The message of every refusal: ``problems[feature] = (layers, setting)``."""
    parts = [f"{_layers(layers)}: {feature} ({setting})" for feature, (layers, setting) in problems.items()]
    return (
        f"augtree cannot replay model {model_type!r} exactly: {'; '.join(parts)} "
        f"{'is' if len(parts) == 1 else 'are'} not implemented by the replay. Train this model on verl's "
        f"stock engine: {STOCK_ENGINE}"
    )


def _layers(layers: list) -> str:
    """[0, 1, 2, 4] -> "layers 0-2, 4"."""
    if not layers:
        return "the model"
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"layer{'s' if len(layers) > 1 else ''} {spans}"


def check_model(model, *, training: bool = True) -> None:
    """``ValueError`` (``refusal``) if ``model`` (a transformers causal LM, possibly on the meta device, before
    FSDP wraps it) has a layer type or feature the replay does not implement; ``training`` False: a forward-only
    engine, where dropout is inactive. Reads the config, the classes and the modules: no model call."""
    config = text_config(model.config)  # the decoder's (a multimodal model's text config)
    model_type = getattr(model.config, "model_type", None) or type(model).__name__
    n = getattr(config, "num_hidden_layers", 0)
    problems: dict[str, tuple[list, str]] = {}

    def add(feature, layer, setting):
        layers, _ = problems.setdefault(feature, ([], setting))
        if layer is not None and layer not in layers:
            layers.append(layer)

    for feature, setting in adapter_problems(model, training=training).items():
        add(feature, None, setting)
    model = causal_lm(model)  # a LoRA model's causal LM, its adapters in place (``replay.adapters``)
    decoder = _check_structure(model, add)
    try:  # the sizes the planner, the memory guard and the FLOP counts read (``model_shape``)
        ModelShape.of(config)
    except ValueError as error:
        add("a config whose sizes augtree cannot read", None, str(error))
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    with_state = {m.layer_idx for m in linear_attention_modules(model)}  # Gated DeltaNet layers (``linear_state``)
    if layer_types:
        for i, kind in enumerate(layer_types):
            if kind == "linear_attention" and i in with_state:
                continue
            if kind != "full_attention":
                setting = f"layer_types {kind!r}" + "".join(
                    f", {name}={value}"
                    for name in LAYER_TYPE_SETTINGS.get(kind, ())
                    if (value := getattr(config, name, None))
                )
                add(LAYER_TYPE_FEATURES.get(kind, f"layer type {kind!r}"), i, setting)
    elif window:  # a sliding window on every layer (Mistral's convention: no layer_types)
        for i in range(n):
            add("sliding-window attention", i, f"sliding_window={window}")
    for name, module in _attention_modules(decoder) if decoder is not None else []:
        layer = _layer_of(name)
        if layer_types and layer is not None and layer < len(layer_types) and layer_types[layer] != "full_attention":
            continue  # refused (or replayed through its state) for its layer type above
        if not _dispatches(module):
            add(
                "attention outside transformers' attention interface (the replay's attention hook never runs)",
                layer,
                f"{type(module).__name__}.forward",
            )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        for i in range(n):
            add("attention logit soft-capping", i, f"attn_logit_softcapping={softcap}")
    dropout = getattr(config, "attention_dropout", None) or 0.0
    if training and dropout > 0:
        for i in range(n):
            add("attention dropout", i, f"attention_dropout={dropout}")
    if training:
        _check_dropout_modules(model, add)
    for name, _ in model.named_parameters():
        if name.rsplit(".", 1)[-1] == "sinks":
            add("attention sinks", _layer_of(name), f"parameter {name.rsplit('.', 2)[-2]}.sinks")
    for name, value in KEY_SELECTION.items():
        if getattr(config, name, None):
            for i in range(n):
                add(value, i, f"{name}={getattr(config, name)}")
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Indexer"):
            add(KEY_SELECTION["index_topk"], _layer_of(name), f"{type(module).__name__} {name}")
        elif getattr(module, "is_causal", True) is False and hasattr(module, "layer_idx"):
            # cross-attention modules (to an encoder's or an image's states) by their names: BART's ``encoder_attn``,
            # Mllama's ``MllamaTextCrossAttention``
            cross = any(word in f"{name}.{type(module).__name__}".lower() for word in ("cross", "encoder_attn"))
            feature = "cross-attention" if cross else "bidirectional attention"
            add(
                f"{feature} (the replay's attention is causal self-attention)",
                _layer_of(name),
                f"{name}.is_causal=False",
            )
    cycles = {name: value for name in CYCLES if isinstance(value := getattr(config, name, None), int) and value > 1}
    if cycles:
        add(
            "layers run in cycles, some without gradient (the prompt's K/V are computed more than once)",
            None,
            ", ".join(f"{k}={v}" for k, v in cycles.items()),
        )
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    for i in range(max(n - shared, 0), n):
        add("K/V shared across layers (a layer reading another layer's K/V)", i, f"num_kv_shared_layers={shared}")
    for setting in stateful_ropes(config):
        add(
            "a rope whose frequencies depend on the engine's earlier calls (each longer call's, kept after it)",
            None,
            setting,
        )
    if problems:
        raise ValueError(refusal(model_type, problems))


# Layer types whose settings name their length; ``LAYER_TYPE_FEATURES`` names the feature.
LAYER_TYPE_SETTINGS = {"sliding_attention": ("sliding_window",), "chunked_attention": ("attention_chunk_size",)}
# Config settings under which a layer's attention keeps only some keys of each query (and the feature they name).
KEY_SELECTION = {
    "index_topk": "per-query key selection (a DeepSeek sparse-attention indexer keeps the top index_topk keys)",
    "keep_window_size": "per-query key selection (a dynamic mask keeps keep_window_size keys and biases them)",
}
# The name every transformers attention module dispatches through ("augtree" is one of its entries)
ATTENTION_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# The class-name suffix of the ``VLMS`` (a refusal names them without it)
VLM_SUFFIX = "ForConditionalGeneration"
# The vision tower's name in a ``VLMS`` model's base model
VISION_TOWER = "visual"
# Words in a sub-config's name that mark an input other than text.
MODALITIES = ("vision", "visual", "image", "video", "audio", "speech", "vq", "perceiver", "qformer", "protein", "vlm")
# Config settings that run the decoder's layers in cycles, some without gradient (recurrent depth, HRM).
CYCLES = ("H_cycles", "L_cycles")
# nn.Dropout's kinds: active in training wherever p > 0
DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def _check_structure(model, add):
    """What the replay calls of a model (see docs/design.md §4): its text decoder (``get_decoder()``) alone, and
    scores through a forward taking ``logits_to_keep``. Returns the decoder; None where there is no text decoder
    the replay could call."""
    cls = type(model)
    vlm = is_vlm(model)  # scored through its LM head alone (``replay.vlm``)
    inputs = _modalities(model.config)
    if inputs and not vlm:
        add(
            "a multimodal model (the replay runs the text decoder, LM head and vision tower of the vision-language "
            f"models {', '.join(sorted(c.removesuffix(VLM_SUFFIX) for c in VLMS))}, and no other multimodal "
            "model's forward)",
            None,
            f"{cls.__name__}: {', '.join(inputs)}",
        )
        return None
    forward = getattr(cls, "forward", None)
    if not vlm and (forward is None or "logits_to_keep" not in inspect.signature(forward).parameters):
        add(
            "a causal-LM forward with logits_to_keep (the replay scores through the family's own forward)",
            None,
            cls.__name__,
        )
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    if decoder is None or decoder is model:
        add(
            "a decoder the replay can call apart from the LM head (get_decoder() returns "
            f"{'nothing' if decoder is None else 'the model itself'})",
            None,
            f"{cls.__name__}, base_model_prefix={getattr(cls, 'base_model_prefix', None)!r}",
        )
        return None
    base = getattr(model, "base_model", None)
    if base is not None and base is not decoder and base is not model:
        inside = {id(p) for p in decoder.parameters()}
        skipped = sorted({name.split(".")[0] for name, p in base.named_parameters() if id(p) not in inside})
        if vlm:  # its vision tower: a text-only row's forward weights it by 0.0 (``replay.vlm``)
            skipped = [name for name in skipped if name != VISION_TOWER]
        if skipped:
            add(
                "a multimodal model: modules around its text decoder that the replay, calling the decoder alone, "
                "would skip",
                None,
                f"{type(base).__name__} modules {', '.join(skipped)}",
            )
    return decoder


def _modalities(config) -> list[str]:
    """The sub-configs of ``config`` that describe an input other than text (a vision tower, an audio encoder)."""
    names = set(getattr(type(config), "sub_configs", None) or ()) | {
        k for k, v in vars(config).items() if k.endswith("_config") and isinstance(v, PretrainedConfig)
    }
    return sorted(k for k in names if any(m in k for m in MODALITIES) and getattr(config, k, None) is not None)


def _attention_modules(decoder) -> list[tuple[str, torch.nn.Module]]:
    """The innermost modules of ``decoder`` whose class is an attention ("...Attention", "...SelfAttention",
    "...Attention2"): the ones that compute it (a wrapper, e.g. BERT's ``BertAttention``, holds its
    ``BertSelfAttention``)."""
    found = [(name, m) for name, m in decoder.named_modules() if re.search(r"Attention\d*$", type(m).__name__)]
    return [
        (name, m)
        for name, m in found
        if not any(other.startswith(name + ".") for other, _ in found if other != name)
        and type(m).__name__ not in STATE_MODULES
    ]


def _dispatches(module) -> bool:
    """Whether ``module``'s forward (its own, else the first in its class's MRO) calls attention through
    transformers' interface."""
    forward = vars(module).get("forward") or next(
        (vars(k)["forward"] for k in type(module).__mro__ if "forward" in vars(k)), None
    )
    try:
        return forward is not None and ATTENTION_INTERFACE in inspect.getsource(forward)
    except (OSError, TypeError):  # no source (a compiled or generated class): the probe's hook check decides
        return True


def _check_dropout_modules(model, add) -> None:
    for name, module in model.named_modules():
        if isinstance(module, DROPOUT_MODULES) and module.p > 0:
            add("dropout in training (a random mask no two runs share)", _layer_of(name), f"{name} p={module.p}")


def _layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter or module name ("model.layers.3.mlp" -> 3), None outside layers."""
    found = re.search(r"\.(\d+)(\.|$)", name)
    return int(found.group(1)) if found else None


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logp: float  # max |log-prob difference| (nats) over the probe's scored tokens
    grad: float  # ||g_replay - g_flat||_2 / ||g_flat||_2 over all parameters


# Probe tolerances by compute dtype. Prompt reuse sums the same terms in another order (attention split
# into [prompt ; response] blocks merged in float32, prompt adjoints accumulated over micro-batches), so
# results differ by the dtype's rounding. Measured on the family matrix's tiny models (tests/families.py,
# 3 seeds each, CPU), the worst rounding and the smallest error of a skipped logit transform (the replay
# scoring lm_head(h) on Granite, Cohere, Gemma2, Gemma3):
#   float32   rounding 4.8e-7 nats / 8.8e-7 relative;  skipped transform >= 0.21 nats / 0.75 relative
#   bfloat16  rounding 7.8e-3 nats / 2.0e-2 relative;  the same
#   float16   rounding 5.3e-4 nats / 1.8e-3 relative;  the same
# Each tolerance sits ~10x or more above the rounding (deeper models round more) and below the skipped
# transforms of the tiny models, whose logits are ~0.1; a trained model's logits (~10-30) make a skipped
# transform an error of many nats.
PROBE_TOLERANCE = {
    torch.float32: Tolerance(logp=1e-4, grad=1e-4),
    torch.bfloat16: Tolerance(logp=0.1, grad=0.2),
    torch.float16: Tolerance(logp=1e-2, grad=2e-2),
}
PROBE_PROMPT, PROBE_RESPONSES, PROBE_SEED = 16, (8, 5), 1234
# Config settings that are lengths at which a family's computation changes (and the rope's
# ``original_max_position_embeddings``, by layer type): the probe runs a tree across each (``probe_lengths``).
LENGTH_SETTINGS = ("sliding_window", "attention_chunk_size", "index_topk", "keep_window_size")
# The short response of the probe's tree at the run's lengths (a second row, in another call than the longest)
PROBE_SHORT_RESPONSE = 5


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    dtype: torch.dtype
    logp_err: float
    grad_err: float  # nan forward only
    seconds: float
    tokens: int  # tokens run by both paths together
    trees: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (prompt length, response lengths) of each probe tree
    row_cap: int | None = None  # the longest row the device holds (None: not capped), see ``probe_exactness``


def length_thresholds(config) -> dict[str, int]:
    """The lengths at which ``config``'s family computes differently, by setting: the rope's
    ``original_max_position_embeddings`` (any rope type: longrope switches factors there, Llama 4 scaling steps
    there) and ``LENGTH_SETTINGS``."""
    found = {
        f"rope original_max_position_embeddings{'' if kind is None else f' ({kind})'}": int(value)
        for kind, params in rope_parameters(config).items()
        if isinstance(value := params.get("original_max_position_embeddings"), int) and value > 0
    }
    for name in LENGTH_SETTINGS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[name] = value
    return found


def probe_lengths(
    config, *, prompt_tokens: int | None = None, response_tokens: int | None = None, row_cap: int | None = None
) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt length, response lengths) of each probe tree:

    - the default tree (``PROBE_PROMPT``, ``PROBE_RESPONSES``);
    - per length threshold T of the config (``length_thresholds``) that the run reaches (below
      ``prompt_tokens + response_tokens`` where both are given), the model's positions reach
      (``max_position_embeddings``) and the device holds (``row_cap``): a prompt of max(1, T - 2) tokens with one
      row ending at T and one at T + 2, so that rows on both sides share a prompt;
    - with the run's lengths (``prompt_tokens``, ``response_tokens``: verl's ``data.max_prompt_length`` and
      ``max_response_length``): their longest row and a short one (``PROBE_SHORT_RESPONSE``) on one prompt,
      scaled down to ``row_cap`` tokens where the device holds fewer.
    """
    trees = [(PROBE_PROMPT, PROBE_RESPONSES)]
    run = prompt_tokens + response_tokens if prompt_tokens and response_tokens else None
    positions = getattr(config, "max_position_embeddings", None)
    limit = min(x for x in (run, row_cap, positions, math.inf) if isinstance(x, (int, float)) and x > 0)
    for t in sorted(set(length_thresholds(config).values())):
        if t + 2 <= limit:
            p = max(1, t - 2)
            trees.append((p, (max(1, t - p), t + 2 - p)))
    if run is not None:
        p, r = prompt_tokens, response_tokens
        if row_cap is not None and run > row_cap:
            p = max(1, p * row_cap // run)
            r = max(1, row_cap - p)
        trees.append((p, (r, min(r, PROBE_SHORT_RESPONSE))))
    return list(dict.fromkeys(trees))


def probe_trees(lengths: list[tuple[int, tuple[int, ...]]], vocab: int, device) -> list[Tree]:
    """Random trees of ``lengths`` (``probe_lengths``), the same on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).to(device)
    return [Tree.of_tokens(ids(p), [ids(r) for r in rs]) for p, rs in lengths]


def _probe_loss(t, i, logp):
    """Per-token weights that differ by token and response (every token's adjoint distinct), plus a square."""
    weights = torch.linspace(-1.0, 1.5, logp.shape[0], device=logp.device) * (1.0 if i == 0 else -0.7)
    return (weights * logp).sum() + 0.05 * (logp**2).sum()


def probe_exactness(
    replay_model,
    forward_model,
    *,
    train: bool,
    lockstep_group=None,
    raise_on_error: bool = True,
    prompt_tokens: int | None = None,
    response_tokens: int | None = None,
    budget_bytes: int | None = None,
    checkpointing: bool = False,
) -> ProbeResult:
    """Prompt reuse against ``forward_model``'s ordinary forward on the probe trees (``probe_lengths``): the
    default short tree, a tree across each length threshold the config declares, and, given the run's lengths
    (``prompt_tokens``, ``response_tokens``), a tree of its longest row.

    ``replay_model``: what ``replay`` runs on (the model, or ``integration.fsdp_model.FSDPReplayModel``);
    ``forward_model``: the module called for the flattened rows (the model, or verl's FSDP root), whose
    ``parameters()`` carry the gradients (FSDP2 shards: errors are summed over ``lockstep_group``, every
    rank of which calls this together). ``train`` False: log-probs only. Gradients existing before the probe
    are restored after it; no optimizer state is touched. ``ValueError`` (with the measured errors) beyond
    ``PROBE_TOLERANCE``, or where a decoder layer's attention does not run through the replay's hook.

    The cap: with ``budget_bytes`` (the replay's memory budget, ``replay.memory.device_budget_bytes``), no probe
    row is longer than the longest row whose forward and backward, every position scored, fits in it
    (``ReplayMemory`` per-token bytes in the compute dtype, ``checkpointing`` as the engine trains; the least over
    ``lockstep_group``); ``row_cap`` of the result. The cost: each tree runs twice (prompt reuse and the flattened
    rows), forward and backward: about 2 x sum over trees of (2 P + R_1 + R_2) tokens (``tokens`` of the result);
    with the run's lengths that is about two training rows of the run's longest length and one of its prompt,
    a fraction of one training step's work.
    """
    start = time.perf_counter()
    config = text_config(forward_model.config)
    model_type = getattr(config, "model_type", None) or type(forward_model).__name__
    embeddings = replay_model.get_input_embeddings()
    device, vocab = embeddings.weight.device, embeddings.num_embeddings
    params = [p for p in forward_model.parameters() if p.requires_grad] if train else []
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            dtype = _check_hooked_layers(
                replay_model, forward_model, model_type, probe_trees(probe_lengths(config), vocab, device)[0]
            )
            cap = _row_cap(config, dtype, checkpointing, train, budget_bytes, lockstep_group, device)
            lengths = probe_lengths(config, prompt_tokens=prompt_tokens, response_tokens=response_tokens, row_cap=cap)
            trees = probe_trees(lengths, vocab, device)
            loss = _probe_loss if train else None
            step = StepPlan.build(trees, lockstep_group=lockstep_group, rope=RopeRegimes.of(config))
            got = replay(replay_model, step, per_response(loss) if loss is not None else None)
            got_grads = [_local(p.grad) for p in params]
            for p in params:
                p.grad = None
            with original_attention(forward_model):
                want = flattened_replay(forward_model, trees, loss, mrope=is_vlm(causal_lm(forward_model)))
            want_grads = [_local(p.grad) for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    logp_err = max((a - b).abs().max().item() for rg, rw in zip(got, want) for a, b in zip(rg, rw))
    grad_err = _grad_error(got_grads, want_grads, lockstep_group) if train else math.nan
    result = ProbeResult(
        dtype=dtype,
        logp_err=logp_err,
        grad_err=grad_err,
        seconds=time.perf_counter() - start,
        tokens=2 * sum(p + r for p, rs in lengths for r in rs),
        trees=tuple(lengths),
        row_cap=cap,
    )
    tol = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
    if raise_on_error and (not logp_err <= tol.logp or (train and not grad_err <= tol.grad)):
        raise ValueError(
            f"augtree's start-up exactness probe: model {model_type!r} ({type(forward_model).__name__}, {dtype}) "
            f"replays with log-prob error {logp_err:.2e} (tolerance {tol.logp:.0e}) and gradient error "
            f"{grad_err:.2e} (tolerance {tol.grad:.0e}) against its own forward on the flattened rows (probe trees "
            f"(prompt, responses) {list(lengths)}): prompt reuse does not reproduce this family's computation. "
            f"Train this model on verl's stock engine: {STOCK_ENGINE}"
        )
    return result


def _row_cap(config, dtype, checkpointing: bool, train: bool, budget_bytes, group, device) -> int | None:
    """The longest row whose forward (and backward) with every position scored fits in ``budget_bytes`` (None:
    no cap), the least over ``group``."""
    if budget_bytes is None:
        return None
    memory = ReplayMemory.of(config, dtype=dtype, checkpointing=checkpointing, train=train, budget_bytes=budget_bytes)
    per_token = memory.layer + memory.head + (memory.saved if train else 0)
    cap = torch.tensor([max(budget_bytes // per_token, 1)], dtype=torch.int64, device=device)
    if group is not None:
        torch.distributed.all_reduce(cap, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(cap.item())


def _check_hooked_layers(replay_model, forward_model, model_type, tree) -> torch.dtype:
    """Every decoder layer's attention (or linear-attention state) runs through the replay's hooks (one prefill
    of the probe prompt, no grad); returns the compute dtype: that of the first layer's captured K (or conv
    window) (under FSDP2 mixed precision the parameters' storage dtype and an output cast may differ from it)."""
    use_augtree_attention(replay_model)
    ctx = PrefillContext()
    positions = torch.arange(tree.prompt_len, device=tree.prompt.device)[None]
    with torch.no_grad():
        replay_model.get_decoder()(
            input_ids=tree.prompt[None], position_ids=positions, attention_mask=None, use_cache=False, augtree_ctx=ctx
        )
    n = getattr(text_config(forward_model.config), "num_hidden_layers", len(ctx.kv))
    missing = [i for i in range(n) if i not in ctx.kv]
    if missing or not ctx.kv:
        layers = getattr(forward_model.get_decoder(), "layers", None)
        names = sorted({type(layers[i]).__name__ for i in missing}) if layers is not None else ["?"]
        raise ValueError(
            refusal(
                model_type,
                {
                    "attention that does not run through the replay's hooks (transformers' attention interface, the "
                    "linear-attention cache)": (missing, ", ".join(names))
                },
            )
        )
    return ctx.kv[0][0].dtype


def _local(grad):
    if grad is None:
        return None
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _grad_error(got, want, group) -> float:
    sums = torch.zeros(2, dtype=torch.float64)
    for g, w in zip(got, want):
        if g is None and w is None:
            continue
        g = torch.zeros_like(w) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        sums[0] += (g.double() - w.double()).pow(2).sum().cpu()
        sums[1] += w.double().pow(2).sum().cpu()
    if group is not None:
        device = next((t.device for t in got + want if t is not None), torch.device("cpu"))
        sums = sums.to(device)
        torch.distributed.all_reduce(sums, group=group)
    diff, ref = sums.tolist()
    return math.sqrt(diff / ref) if ref > 0 else math.sqrt(diff)
