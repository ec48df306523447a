"""What the replay refuses, by name, before any work, and the start-up exactness probe.

``check_model(model)`` reads the model's config and modules: every layer type or feature the replay does not
implement (a layer type other than full attention and the Gated DeltaNet layers of ``linear_state``, sliding windows,
attention logit soft-capping, attention sinks, attention dropout, a forward without ``logits_to_keep``)
raises one ``ValueError`` naming the model type, the layers, the features with their settings, and the
setting that trains the model on verl's stock engine instead (``STOCK_ENGINE``).

``probe_exactness(...)`` runs a few dozen tokens of the user's own model through prompt reuse and through
the model's ordinary forward on the flattened rows (one prompt, two short responses, forward and
backward), compares log-probs and gradients, and refuses beyond ``PROBE_TOLERANCE`` of the compute dtype
with the measured errors. It catches what no list can: a family that changes logits or hidden states in a
way the replay does not reproduce. The engine runs both at build (``integration/engine.py``); the
attention hook keeps its per-call refusal of the same attention features for direct ``replay`` callers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import time

import torch

from augtree_verl.groups import Tree
from augtree_verl.replay.adapters import adapter_problems, causal_lm
from augtree_verl.replay.attention import PrefillContext, original_attention, use_augtree_attention
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.engine import per_response, replay
from augtree_verl.replay.linear_state import STATE_MODULES, linear_attention_modules
from augtree_verl.replay.memory import STOCK_ENGINE
from augtree_verl.replay.step_plan import StepPlan

# ``config.layer_types`` entries and what the replay would need to implement for them.
LAYER_TYPE_FEATURES = {
    "sliding_attention": "sliding-window attention",
    "linear_attention": f"linear attention outside {', '.join(sorted(STATE_MODULES))}",
    "chunked_attention": "chunked attention",
}


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


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
    """``ValueError`` (``refusal``) if ``model`` (a transformers causal LM, possibly FSDP-wrapped or on the meta
    device) has a layer type or feature the replay does not implement; ``training`` False: a forward-only
    engine, where attention dropout is inactive."""
    config = _text_config(model.config)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    n = getattr(config, "num_hidden_layers", 0)
    problems: dict[str, tuple[list, str]] = {}

    def add(feature, layer, setting):
        layers, _ = problems.setdefault(feature, ([], setting))
        if layer is not None and layer not in layers:
            layers.append(layer)

    for feature, setting in adapter_problems(model, training=training).items():
        add(feature, None, setting)
    model = causal_lm(model)  # a LoRA model's causal LM, its adapters in place (``replay.adapters``)
    forward = getattr(type(model), "forward", None)
    if (
        getattr(model, "get_decoder", None) is None
        or forward is None
        or "logits_to_keep" not in inspect.signature(forward).parameters
    ):
        add(
            "a causal-LM forward with logits_to_keep (the replay scores through the family's own forward)",
            None,
            type(model).__name__,
        )
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    with_state = {m.layer_idx for m in linear_attention_modules(model)}  # Gated DeltaNet layers (``linear_state``)
    if layer_types:
        for i, kind in enumerate(layer_types):
            if kind == "linear_attention" and i in with_state:
                continue
            if kind != "full_attention":
                window_setting = f", sliding_window={window}" if kind == "sliding_attention" else ""
                setting = f"layer_types {kind!r}" + window_setting
                add(LAYER_TYPE_FEATURES.get(kind, f"layer type {kind!r}"), i, setting)
    elif window:  # a sliding window on every layer (Mistral's convention: no layer_types)
        for i in range(n):
            add("sliding-window attention", i, f"sliding_window={window}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        for i in range(n):
            add("attention logit soft-capping", i, f"attn_logit_softcapping={config.attn_logit_softcapping}")
    if training and (getattr(config, "attention_dropout", None) or 0.0) > 0:
        for i in range(n):
            add("attention dropout", i, f"attention_dropout={config.attention_dropout}")
    for name, _ in model.named_parameters():
        if name.rsplit(".", 1)[-1] == "sinks":
            layer = re.search(r"\.(\d+)\.", name)
            add("attention sinks", int(layer.group(1)) if layer else None, f"parameter {name.rsplit('.', 2)[-2]}.sinks")
    if problems:
        raise ValueError(refusal(model_type, problems))


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


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    dtype: torch.dtype
    logp_err: float
    grad_err: float  # nan forward only
    seconds: float
    tokens: int  # tokens run by both paths together


def probe_tree(vocab: int, device) -> Tree:
    g = torch.Generator().manual_seed(PROBE_SEED)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).to(device)
    return Tree.of_tokens(ids(PROBE_PROMPT), [ids(r) for r in PROBE_RESPONSES])


def _probe_loss(t, i, logp):
    """Per-token weights that differ by token and response (every token's adjoint distinct), plus a square."""
    weights = torch.linspace(-1.0, 1.5, logp.shape[0], device=logp.device) * (1.0 if i == 0 else -0.7)
    return (weights * logp).sum() + 0.05 * (logp**2).sum()


def probe_exactness(
    replay_model, forward_model, *, train: bool, lockstep_group=None, raise_on_error: bool = True
) -> ProbeResult:
    """Prompt reuse against ``forward_model``'s ordinary forward on one probe tree (``probe_tree``).

    ``replay_model``: what ``replay`` runs on (the model, or ``integration.fsdp_model.FSDPReplayModel``);
    ``forward_model``: the module called for the flattened rows (the model, or verl's FSDP root), whose
    ``parameters()`` carry the gradients (FSDP2 shards: errors are summed over ``lockstep_group``, every
    rank of which calls this together). ``train`` False: log-probs only. Gradients existing before the probe
    are restored after it; no optimizer state is touched. ``ValueError`` (with the measured errors) beyond
    ``PROBE_TOLERANCE``, or where a decoder layer's attention does not run through the replay's hook.
    """
    start = time.perf_counter()
    config = _text_config(forward_model.config)
    model_type = getattr(config, "model_type", None) or type(forward_model).__name__
    device = replay_model.get_input_embeddings().weight.device
    tree = probe_tree(replay_model.get_input_embeddings().num_embeddings, device)
    params = [p for p in forward_model.parameters() if p.requires_grad] if train else []
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            dtype = _check_hooked_layers(replay_model, forward_model, model_type, tree)
            loss = _probe_loss if train else None
            step = StepPlan.build([tree], lockstep_group=lockstep_group)
            got = replay(replay_model, step, per_response(loss) if loss is not None else None)
            got_grads = [_local(p.grad) for p in params]
            for p in params:
                p.grad = None
            with original_attention(forward_model):
                want = flattened_replay(forward_model, [tree], loss)
            want_grads = [_local(p.grad) for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    logp_err = max((a - b).abs().max().item() for a, b in zip(got[0], want[0]))
    grad_err = _grad_error(got_grads, want_grads, lockstep_group) if train else math.nan
    result = ProbeResult(
        dtype=dtype,
        logp_err=logp_err,
        grad_err=grad_err,
        seconds=time.perf_counter() - start,
        tokens=2 * sum(PROBE_PROMPT + r for r in PROBE_RESPONSES),
    )
    tol = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
    if raise_on_error and (not logp_err <= tol.logp or (train and not grad_err <= tol.grad)):
        raise ValueError(
            f"augtree's start-up exactness probe: model {model_type!r} ({type(forward_model).__name__}, {dtype}) "
            f"replays with log-prob error {logp_err:.2e} (tolerance {tol.logp:.0e}) and gradient error "
            f"{grad_err:.2e} (tolerance {tol.grad:.0e}) against its own forward on the flattened rows: prompt "
            f"reuse does not reproduce this family's computation. Train this model on verl's stock engine: "
            f"{STOCK_ENGINE}"
        )
    return result


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
    n = getattr(_text_config(forward_model.config), "num_hidden_layers", len(ctx.kv))
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
