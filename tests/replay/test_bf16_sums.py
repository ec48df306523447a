"""bfloat16: the long sums (prompt dK/dV over many response micro-batches) run in float32.

A prompt-heavy tree whose 16 responses run as 16 micro-batches: replay in bfloat16 against a float32
reference (the same bf16-rounded weights, float32 arithmetic, flattened), compared with the flattened
bfloat16 baseline's own error against that reference. Summing dK/dV in bfloat16 adds about sqrt(16)
ulps to every prompt-side gradient; with float32 leaves our error stays at the baseline's.
"""

from __future__ import annotations

import copy

import torch

from augtree_verl import StepPlan, Tree, per_response, replay
from augtree_verl.replay.baseline import flattened_replay
from tests.parity import VOCAB, rel_err, tiny_model

PROMPT, RESPONSE, G = 256, 8, 16
# "no more than the flattened bf16 baseline's error", with room for the different (not worse) rounding order.
ERROR_RATIO = 1.5


def _run(fn, model, tree, advantages):
    model.zero_grad(set_to_none=True)
    logps = fn(model, [tree], lambda t, i, logp: -(logp * advantages[i]).mean())
    return torch.cat([x.float() for x in logps[0]]), {n: p.grad.float() for n, p in model.named_parameters()}


def test_bf16_replay_is_as_accurate_as_the_flattened_bf16_baseline():
    bf16 = tiny_model().to(torch.bfloat16)
    reference = copy.deepcopy(bf16).float()
    g = torch.Generator().manual_seed(0)
    tree = Tree.of_tokens(
        prompt=torch.randint(0, VOCAB, (PROMPT,), generator=g),
        responses=[torch.randint(0, VOCAB, (RESPONSE,), generator=g) for _ in range(G)],
    )
    advantages = torch.randn(G, generator=g)
    stats = {}

    def ours(model, trees, loss_fn):
        from augtree_verl.replay import ReplayOptions, ReplayStats

        stats["replay"] = ReplayStats()
        step_plan = StepPlan.build(trees, micro_batch_tokens=RESPONSE)
        return replay(model, step_plan, per_response(loss_fn), ReplayOptions(stats=stats["replay"]))

    want_logp, want_grads = _run(flattened_replay, reference, tree, advantages)
    base_logp, base_grads = _run(flattened_replay, bf16, tree, advantages)
    our_logp, our_grads = _run(ours, bf16, tree, advantages)
    assert stats["replay"].micro_batches >= 16
    checks = {"log-probs": (our_logp, base_logp, want_logp)}
    checks.update({f"grad {n}": (our_grads[n], base_grads[n], want_grads[n]) for n in want_grads})
    for what, (got, base, want) in checks.items():
        ours_err, base_err = rel_err(got, want), rel_err(base, want)
        assert ours_err <= ERROR_RATIO * base_err, f"{what}: ours {ours_err:.2e} vs flattened bf16 {base_err:.2e}"
