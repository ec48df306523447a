"""Hybrid Gated DeltaNet models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) in the replay (``replay.linear_state``),
float32 CPU: the prompt's per-layer state (K/V, or conv window and recurrent state) against the flattened
baseline over optimizer steps, with checkpointing on and off and one- and multi-row micro-batches; the state
leaves and their gradients; MoE router logits; context-parallel plans of hybrids the state scan does not cover
refused by name or demoted."""

from __future__ import annotations

import pytest
import torch

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.plan import Plan
from augtree_verl.replay import Offload, ReplayStats
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.linear_state import demote_cp_plans
from augtree_verl.replay.model_check import PROBE_TOLERANCE, probe_exactness
from augtree_verl.replay.prompt_kv import PromptKV
from tests.families import VOCAB, family_model
from tests.parity import assert_grads_match, assert_logps_match, plan_and_options
from tests.replay.test_engine_parity import grpo_like_loss, run_both

# A prompt longer than the delta rule's 64-token chunk; responses of 1 and 2 tokens (none and one fed).
PROMPTS, RESPONSES = [70, 3], [[5, 1, 9, 2], [4, 2]]
LOSS = grpo_like_loss([[1.0, -0.5, 2.0, 0.3], [0.7, -1.1]])


def _replay(model, trees, loss=None, **kw):
    """The module's direct ``replay`` calls (``run_both`` makes the others)."""
    build, options = plan_and_options(kw)
    return replay(model, StepPlan.build(trees, **build), per_response(loss) if loss is not None else None, options)


def _trees(seed: int = 0) -> list[Tree]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g)
    return [Tree.of_tokens(ids(p), [ids(r) for r in rs]) for p, rs in zip(PROMPTS, RESPONSES)]


@pytest.mark.parametrize(
    "name,checkpointing,micro_batch_tokens",
    [
        ("qwen3.5", False, 1),  # one row per call
        ("qwen3-next", True, 16),  # several rows per call, right padded; prompt activations offloaded
    ],
)
def test_optimizer_steps_match_flattened(name, checkpointing, micro_batch_tokens):
    """Before each of 2 SGD steps, replay and the flattened baseline on the same weights agree."""
    model = family_model(name)
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        offload = Offload(ReplayStats(), min_bytes=0) if checkpointing else None
        got, gg, want, gw = run_both(model, _trees(step), LOSS, micro_batch_tokens=micro_batch_tokens, offload=offload)
        assert_logps_match(got, want)
        assert_grads_match(gg, gw)
        for p, g in zip(model.parameters(), gg.values()):
            p.grad = g
        optimizer.step()


def test_linear_state_leaves_take_the_responses_gradients(monkeypatch):
    """A linear layer's prompt state is (conv [1, conv_dim, K], recurrent [1, H_v, D_k, D_v]), an attention
    layer's (k, v); every leaf has a float32 gradient sum from the responses when the delayed backward runs."""
    seen = []
    backward = PromptKV.backward

    def record(self):
        seen.append([(tuple(x.shape), x.grad_sum) for pair in self.kv for x in pair])
        backward(self)

    monkeypatch.setattr(PromptKV, "backward", record)
    model = family_model("qwen3.5")
    _replay(model, _trees()[:1], LOSS)
    attn = model.model.layers[1].self_attn
    linear = model.model.layers[0].linear_attn
    kv_shape = (1, model.config.num_key_value_heads, PROMPTS[0], attn.head_dim)
    assert [shape for shape, _ in seen[0]] == [
        (1, linear.conv_dim, linear.conv_kernel_size),
        (1, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim),
        kv_shape,
        kv_shape,
    ]
    for _, grad in seen[0]:
        assert grad is not None and grad.dtype == torch.float32 and grad.abs().max() > 0


def test_forward_only_matches():
    model = family_model("qwen3.5-moe")
    got = _replay(model, _trees(), temperature=0.7)
    assert_logps_match(got, flattened_replay(model, _trees(), temperature=0.7))


def test_bf16_probe_passes():
    """(float16: the model's own torch kernels give non-finite gradients in the flattened forward too, and the
    probe refuses.)"""
    result = probe_exactness(*[family_model("qwen3-next", dtype=torch.bfloat16)] * 2, train=True)
    tol = PROBE_TOLERANCE[torch.bfloat16]
    assert result.dtype == torch.bfloat16 and result.logp_err <= tol.logp and result.grad_err <= tol.grad


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3.5-moe"])
def test_moe_with_router_logits_on(name):
    """``output_router_logits`` makes the forward compute the load-balancing loss, which no loss verl
    optimises contains (docs/design.md §4): log-probs and gradients stay those of the flattened rows. (Off:
    ``test_families``.)"""
    model = family_model(name)
    model.config.output_router_logits = True
    got, gg, want, gw = run_both(model, _trees(), LOSS, micro_batch_tokens=16)
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)


def test_context_parallel_plan_refused_by_name():
    """A hybrid whose linear-attention layers the state scan does not cover (``cp.state_scan``: the Gated
    DeltaNet families only)."""
    model = family_model("olmo-hybrid")
    trees = _trees()
    step_plan = StepPlan(trees=trees, plans=[None, Plan(degree=2)], slots=[])  # as a caller with a CP group has it
    with pytest.raises(ValueError, match=r"tree 1: a plan of degree 2, but model 'olmo_hybrid' has linear-attention"):
        replay(model, step_plan, per_response(LOSS))


def test_context_parallel_plans_demoted_and_counted():
    """Demoted where the scan does not cover the linear layers; the Gated DeltaNet families keep their CP plans
    (``tests/cp/test_hybrid_cp.py`` runs them)."""
    cp = Plan(degree=4, est_time_s=1.0, est_single_s=3.0)
    plans = [cp, Plan(est_time_s=2.0), None]
    demoted, count = demote_cp_plans(family_model("olmo-hybrid").config, plans)
    assert count == 1 and demoted == [Plan(est_time_s=3.0), plans[1], None]
    for name in ("qwen3", "qwen3.5", "qwen3.5-moe", "qwen3-next"):
        assert demote_cp_plans(family_model(name).config, plans) == (plans, 0), name
