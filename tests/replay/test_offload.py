"""Prompt-activation offload (``replay.offload``): exact gradients with it on, what moves and what stays, the
host pool, the layer-ahead prefetch, and the memory meter's device vs host bytes. float32 on CPU."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from augtree_verl.replay import (
    Offload,
    ReplayOptions,
    ReplayStats,
    StepPlan,
    held_prompt_tensors,
    per_response,
    replay,
)
from augtree_verl.replay.baseline import flattened_replay
from tests.parity import VOCAB, assert_grads_match, assert_logps_match, grads, random_trees, rel_err, tiny_model
from tests.replay.test_engine_parity import grpo_like_loss, run_both


def deep_model(layers: int, seed: int):
    """tests.parity's qwen2-gqa shape with ``layers`` decoder layers, gradient checkpointing on."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).float().train()
    model.gradient_checkpointing_enable()
    return model


def offloaded_run(model, trees, loss_fn, **kw):
    """``run_both`` with an ``Offload`` that moves every storage (the tiny model's are all small)."""
    stats = ReplayStats()
    offload = Offload(stats, min_bytes=0)
    result = run_both(model, trees, loss_fn, offload=offload, stats=stats, **kw)
    return result, stats, offload


@pytest.mark.parametrize(
    "name,checkpointing", [("qwen2-gqa", True), ("qwen2-gqa", False), ("llama-mha", True), ("qwen3-gqa", False)]
)
def test_parity_with_offload(name, checkpointing):
    model = tiny_model(name, seed=5)
    if checkpointing:
        model.gradient_checkpointing_enable()
    trees = random_trees([40, 9, 1], [[7, 12, 3], [5, 2], [3, 1]], seed=5)
    adv = [[1.0, -0.5, 2.0], [0.3, -1.0], [0.7, 1.1]]
    (got, gg, want, gw), stats, offload = offloaded_run(
        model, trees, grpo_like_loss(adv), micro_batch_tokens=20, temperature=0.8
    )
    assert_logps_match(got, want)
    assert_grads_match(gg, gw)
    assert stats.offloaded_bytes > 0 and stats.offload_copies > 0 and offload.peak_host_bytes > 0
    assert offload.host_bytes == 0 and offload.device_storages() == []  # all released after the backwards
    if checkpointing:  # the boundaries come back in reverse order: every one ahead of its use
        assert stats.prefetched_bytes == stats.offloaded_bytes


@pytest.mark.slow
def test_parity_with_offload_over_several_optimizer_steps():
    model = tiny_model("qwen2-gqa", seed=7)
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        trees = random_trees([30 + step, 5], [[4, 9, 2, 6], [12, 1, 7]], seed=100 + step)
        adv = [[1.0, -1.0, 0.5, -0.5], [2.0, -1.0, 0.1]]
        (got, gg, want, gw), _, _ = offloaded_run(model, trees, grpo_like_loss(adv), micro_batch_tokens=12)
        assert_logps_match(got, want)
        assert_grads_match(gg, gw)
        for p, g in zip(model.parameters(), gg.values()):
            p.grad = g
        optimizer.step()


def _saved_storages(model, trees):
    """(storage bytes the prefill saves (every saved tensor's storage once), those of parameters)."""
    from augtree_verl.replay.attention import PrefillContext, use_augtree_attention

    use_augtree_attention(model)
    seen, params = {}, {}

    def pack(x):
        storage = x.untyped_storage()
        (params if isinstance(x, torch.nn.Parameter) or isinstance(x._base, torch.nn.Parameter) else seen)[
            storage.data_ptr()
        ] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.get_decoder()(
            input_ids=trees[0].prompt[None], attention_mask=None, use_cache=False, augtree_ctx=PrefillContext()
        )
    return seen, params


def test_checkpointing_moves_exactly_the_boundaries_and_the_norm_inputs():
    """With checkpointing the prefill saves each layer's input [1, P, hidden] and the final norm's tensors;
    all of those move (above the threshold), the norm weight (a parameter) does not."""
    model = tiny_model("qwen2-gqa", seed=1)
    model.gradient_checkpointing_enable()
    trees = random_trees([64], [[5, 3]], seed=1)
    boundary = 64 * model.config.hidden_size * 4
    saved, params = _saved_storages(model, trees)
    moved = sum(n for n in saved.values() if n >= boundary)
    assert moved >= model.config.num_hidden_layers * boundary and params
    stats = ReplayStats()
    options = ReplayOptions(offload=Offload(stats, min_bytes=boundary), stats=stats)
    replay(model, StepPlan.build(trees), per_response(lambda t, i, lp: lp.sum()), options)
    assert stats.offloaded_bytes == moved  # one tree: each storage once, nothing smaller, no parameter


def test_prompt_kv_stay_on_the_device_without_checkpointing():
    """Without checkpointing SDPA saves the prompt K/V themselves: their storages are still alive after the
    forward (they are the responses' leaves), so they are kept, and their host copies dropped."""
    model = tiny_model("qwen2-gqa", seed=2)
    trees = random_trees([48], [[4, 6]], seed=2)
    saved, _ = _saved_storages(model, trees)
    stats = ReplayStats()
    offload = Offload(stats, min_bytes=0)
    kept = []  # device bytes the offload keeps while the responses replay

    def loss_fn(t, i, logp):
        kept.append(sum(s.nbytes() for s in offload.device_storages()))
        return logp.sum()

    replay(model, StepPlan.build(trees), per_response(loss_fn), ReplayOptions(offload=offload, stats=stats))
    kv = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 48 * 16 * 4  # k, v per layer
    assert kept[0] >= kv  # K/V (and small saved tensors) left in place
    assert stats.offloaded_bytes <= sum(saved.values()) - kv


def test_restored_storages_stay_one_layer_ahead():
    """During the prompt backward at most two boundaries are on the device: the one in use and the next."""
    model = deep_model(4, seed=3)
    p = 96
    boundary = p * model.config.hidden_size * 4
    trees = random_trees([p], [[3, 5]], seed=3)
    offload = Offload(min_bytes=boundary)
    most = []

    def sample(module, args):
        if offload._restoring is not None:
            most.append(sum(s.nbytes() >= boundary for s in offload.device_storages()))

    handles = [layer.register_forward_pre_hook(sample) for layer in model.model.layers]
    replay(model, StepPlan.build(trees), per_response(lambda t, i, lp: lp.sum()), ReplayOptions(offload=offload))
    for h in handles:
        h.remove()
    assert most and max(most) <= 2 < model.config.num_hidden_layers, most
    assert offload.stats.prefetched_bytes == offload.stats.offloaded_bytes > 0


def test_no_prefetch_restores_on_demand():
    model = tiny_model("qwen2-gqa", seed=4)
    model.gradient_checkpointing_enable()
    trees = random_trees([32], [[4, 2]], seed=4)
    loss_fn = grpo_like_loss([[1.0, -1.0]])
    (_, prefetched_grads, _, _), prefetched, _ = offloaded_run(model, trees, loss_fn)
    stats = ReplayStats()
    model.zero_grad(set_to_none=True)
    options = ReplayOptions(offload=Offload(stats, min_bytes=0, ahead_bytes=0))
    replay(model, StepPlan.build(trees), per_response(loss_fn), options)
    assert stats.prefetched_bytes == 0 < prefetched.prefetched_bytes
    assert (stats.offloaded_bytes, stats.offload_copies) == (prefetched.offloaded_bytes, prefetched.offload_copies)
    for name, g in grads(model).items():
        assert torch.equal(g, prefetched_grads[name])  # the same bytes come back, prefetched or not


def test_shared_storage_is_copied_once_and_views_come_back_as_views():
    def f(x):
        h = x * 2  # saved three times: as itself, and through two views of its storage
        return (h * h).sum() + (h[8:].t() @ h[8:]).sum()

    x = torch.randn(64, 32, requires_grad=True)
    offload = Offload(min_bytes=0)
    with offload.saving():
        y = f(x)
    assert offload.stats.offload_copies == 1 and offload.stats.offloaded_bytes == x.numel() * 4
    with offload.restoring():
        y.backward()
    assert offload.stats.offload_copies == 2 and offload.host_bytes == 0
    assert rel_err(x.grad, torch.autograd.grad(f(x), x)[0]) <= 1e-6


def test_a_storage_still_alive_after_the_forward_stays_on_the_device():
    x = torch.randn(64, 32, requires_grad=True)
    offload = Offload(min_bytes=0)
    with offload.saving():
        h = x * 2  # still referenced after the block: moving it would free nothing
        y = (h * h).sum()
    assert offload.stats.offloaded_bytes == 0 and offload.host_bytes == 0
    assert [s.data_ptr() for s in offload.device_storages()] == [h.untyped_storage().data_ptr()]
    with offload.restoring():
        y.backward()
    assert rel_err(x.grad, 8 * x.detach()) <= 1e-6


def test_a_retained_graph_can_be_replayed_after_restoring():
    x = torch.randn(300, requires_grad=True)
    offload = Offload(min_bytes=0)
    with offload.saving():
        y = (x.exp() * 3).sin().sum()
    with offload.restoring():
        y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()  # outside restoring(): copies back on demand
    assert torch.allclose(x.grad, 2 * first)


def test_misuse_raises():
    with pytest.raises(ValueError, match="restoring"):
        with Offload().restoring():
            pass
    with pytest.raises(ValueError, match="min_bytes"):
        Offload(min_bytes=-1)
    with pytest.raises(ValueError, match="ahead_bytes"):
        Offload(ahead_bytes=1.5)
    offload = Offload()
    with pytest.raises(ValueError, match="nest"):
        with offload.saving(), offload.saving():
            pass


def test_forward_only_ignores_offload():
    model = tiny_model("qwen2-gqa", seed=8)
    trees = random_trees([25], [[5, 1, 9]], seed=8)
    offload = Offload(min_bytes=0)
    got = replay(model, StepPlan.build(trees), None, ReplayOptions(offload=offload))
    assert_logps_match(got, flattened_replay(model, trees))
    assert offload.stats.offload_copies == 0


def test_meter_counts_device_bytes_and_host_bytes_apart():
    """``UnshardedGroups`` on a plain (unsharded) model: peak saved + prompt bytes on the device drop with
    offload, the host pool holds the boundaries, and the held prompt tensors are counted either way."""
    from augtree_verl.integration.memory_meter import UnshardedGroups

    model = deep_model(6, seed=9)
    p = 512
    trees = random_trees([p], [[4, 4]], seed=9)
    kv = 2 * 6 * model.config.num_key_value_heads * p * 16 * 4
    seen = {}
    for on in (False, True):
        offload = Offload(min_bytes=4096) if on else None
        held = []

        def loss_fn(t, i, logp):
            held.append(sum(x.numel() * x.element_size() for x in held_prompt_tensors()))
            return logp.sum()

        with UnshardedGroups(model) as meter:
            replay(model, StepPlan.build(trees), per_response(loss_fn), ReplayOptions(offload=offload))
        seen[on] = (meter.peak_bytes, meter.peak_host_bytes)
        assert meter.peak_bytes >= max(held) >= kv  # K/V leaves, last hidden, grad sums are counted
    boundaries = 6 * p * model.config.hidden_size * 4
    assert seen[False][1] == 0 and seen[True][1] >= boundaries
    assert seen[True][0] <= seen[False][0] - boundaries, seen
