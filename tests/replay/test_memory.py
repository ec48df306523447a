"""The replay's peak-memory estimate (``replay.memory``) against a measurement, and the refusal of a step over
its budget: by name, before any model call, on every rank of a lock-step group at once.

The measurement (``LiveTensorBytes``): every tensor storage an operation creates during the replay is counted
from its creation until torch frees it (its Python storage object is kept alive by torch as long as the C++
storage, saved-for-backward tensors included), minus the offload's host pool (on CPU its copies are ordinary
tensors, on CUDA pinned host memory); the peak of that sum is the bytes of tensors alive at once, what CUDA's
``max_memory_allocated`` reports on a GPU, less the kernels' internal scratch buffers. Parameters and their
gradients exist before the measured step (a step has run already) and are not counted, as in the estimate.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from augtree_verl import ReplayOptions, StepPlan, Tree, per_response, replay
from augtree_verl.replay import Offload
from augtree_verl.replay.lockstep import TrieSlot
from augtree_verl.replay.memory import GIB, ReplayMemory, ReplayMemoryError, device_budget_bytes
from augtree_verl.replay.offload import live_offloads
from tests.cp.distributed import run_distributed
from tests.parity import VOCAB, assert_grads_match, assert_logps_match, grads, random_trees, tiny_model
from tests.replay.test_trie import sharing_batch

# The estimate is a sum of named per-token terms, not a simulation of the allocator: it must land within this
# factor of the measured peak either way (measured: 0.75x to 1.34x over the cases below).
FACTOR = 1.5
MIB = 1 << 20


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as meter: ...``; ``meter.peak``: the most bytes of tensor storages created
    inside the block alive at once, less the live offloads' host pools (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_nested:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now - sum(o.host_bytes for o in live_offloads()))
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def _ids(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=g)


def deep_chain(prompt: int = 1500, turn: int = 300, turns: int = 3) -> list[Tree]:
    """Multi-turn rows: turn k's prompt is a shared system prompt and k turns (a chain of nested prompts:
    nodes [0, prompt + turn), [.., prompt + 2 turn), ...), one 200-token answer each; uids "t1", "t2", ..."""
    g = torch.Generator().manual_seed(0)
    system, turns_ids = _ids(g, prompt), _ids(g, turn * turns)
    return [
        Tree.of_tokens(torch.cat([system, turns_ids[: turn * k]]), [_ids(g, 200)], uid=f"t{k}", samples=[k - 1])
        for k in range(1, turns + 1)
    ]


BATCHES = {
    "prompt-heavy": lambda: random_trees([2000], [[40, 50, 30, 20]]),
    "response-heavy": lambda: random_trees([64], [[600, 500, 400, 300]]),
    "deep-chain": deep_chain,
    "sharing": sharing_batch,
}


def _model(checkpointing: bool):
    model = tiny_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _memory(model, checkpointing: bool, train: bool = True, budget_bytes: int = 0) -> ReplayMemory:
    return ReplayMemory.of(
        model.config, dtype=torch.float32, checkpointing=checkpointing, train=train, budget_bytes=budget_bytes
    )


def _loss():
    return per_response(lambda t, i, logp: -logp.mean())


@pytest.mark.parametrize(
    "batch, checkpointing, offload, train",
    [
        ("prompt-heavy", False, False, True),
        ("prompt-heavy", True, False, True),
        ("prompt-heavy", True, True, True),
        ("response-heavy", False, False, True),
        ("response-heavy", True, False, True),
        ("deep-chain", False, True, True),
        ("deep-chain", True, False, True),
        ("sharing", False, False, True),
        ("prompt-heavy", False, False, False),
        ("response-heavy", True, False, False),
    ],
)
def test_estimate_is_within_a_factor_of_the_measured_peak(batch, checkpointing, offload, train):
    trees = BATCHES[batch]()
    model = _model(checkpointing)
    loss = _loss() if train else None

    def options():
        return ReplayOptions(offload=Offload() if offload else None)

    replay(model, StepPlan.build(trees), loss, options())  # parameter gradients exist before the measured step
    step_plan = StepPlan.build(trees)
    memory = _memory(model, checkpointing, train)
    estimate = max(memory.peak(s.node, offload=offload)[0] for s in step_plan.slots if isinstance(s, TrieSlot))
    with LiveTensorBytes() as meter:
        replay(model, step_plan, loss, options())
    ratio = estimate / meter.peak
    assert 1 / FACTOR <= ratio <= FACTOR, (
        f"{batch}: estimate {estimate / MIB:.2f} MiB, measured {meter.peak / MIB:.2f} MiB (ratio {ratio:.2f})"
    )


def test_sizes_of_a_7b_model_follow_the_config():
    """Qwen2.5-7B's shape: bf16 K/V of 28 layers x 2 x 4 heads x 128 = 56 KiB per token, float32 sums twice that
    (design.md §8: 1.6 GB of K/V and 3.3 GB of sums at 28k tokens)."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    )
    memory = ReplayMemory.of(config, dtype=torch.bfloat16, checkpointing=True, train=True, budget_bytes=0)
    assert memory.kv == 28 * 2 * 4 * 128 * 2 and memory.kv_sum == 2 * memory.kv
    assert memory.saved == (28 + 2) * 3584 * 2  # each layer's input and the final norm's
    assert memory.head == 152064 * (2 + 3 * 4)


def test_a_context_parallel_root_holds_the_gathered_kv_and_its_shard():
    """A trie whose root runs context-parallel over d members (``replay.cp_trie``): each member holds the root's
    whole gathered K/V and sums, plus its shard's K/V, sums, saved activations; its prefill call is n / d
    tokens. A long root's saved activations dominate, so the root over 4 members needs less than on one."""
    trees = [Tree.of_tokens(torch.arange(3, 3 + 4000), [torch.tensor([5, 6, 7])] * 2 + [torch.tensor([8, 9])])]
    root = StepPlan.build(trees).slots[0].node
    memory = _memory(_model(checkpointing=False), checkpointing=False)
    n, shard = root.length, 1000
    assert memory.resident(root, offload=False, degree=4) == (
        n * (memory.kv + memory.kv_sum) + shard * (memory.kv + memory.kv_sum + memory.saved) + memory.hidden
    )
    assert memory.call(root, 4) == shard * memory.layer
    assert memory.peak(root, offload=False, degree=4)[0] < memory.peak(root, offload=False)[0]


def test_budget_is_the_knob_or_none_on_cpu():
    assert device_budget_bytes(2.5, torch.device("cpu")) == int(2.5 * GIB)
    assert device_budget_bytes(None, torch.device("cpu")) is None


def _chain_estimate(model, trees) -> tuple[int, StepPlan]:
    step_plan = StepPlan.build(trees)
    return max(_memory(model, False).peak(s.node, offload=False)[0] for s in step_plan.slots), step_plan


def test_over_budget_trie_is_refused_naming_the_node_and_its_length():
    model, trees = tiny_model(), deep_chain()
    estimate, _ = _chain_estimate(model, trees)
    with pytest.raises(ReplayMemoryError) as error:
        StepPlan.build(trees, memory=_memory(model, False, budget_bytes=estimate - 1))
    message = str(error.value)
    # the deepest node: the third turn's, after the system prompt and two turns
    assert "at its node of tokens [2100, 2400) (300 tokens, depth 3" in message, message
    assert "tree 0 (uid 't1', samples [0]); tree 1 (uid 't2', samples [1]); tree 2 (uid 't3', samples [2])" in message
    assert f"needs about {estimate / GIB:.3g} GiB" in message and f"budget of {(estimate - 1) / GIB:.3g} GiB" in message
    for way_out in ("micro_batch_tokens", "offload_prompt_activations", "cp_degrees", "strategy=fsdp2"):
        assert way_out in message
    assert all(p.grad is None for p in model.parameters()), "refused before any model call"


def test_under_budget_runs_unchanged():
    model, trees = tiny_model(), deep_chain(prompt=200, turn=40)
    estimate, step_plan = _chain_estimate(model, trees)
    want = replay(model, step_plan, _loss())
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    checked = StepPlan.build(trees, memory=_memory(model, False, budget_bytes=estimate))
    assert_logps_match(replay(model, checked, _loss()), want, rtol=0.0)
    assert_grads_match(grads(model), want_grads, rtol=0.0)


def _only_rank_1_over(rank, world):
    """Rank 0 replays a small group, rank 1 a 2,000-token prompt; the budget sits between their estimates."""
    model = tiny_model()
    trees = random_trees([16], [[4, 6]]) if rank == 0 else random_trees([2000], [[40, 50]], seed=1)
    memory = _memory(model, False, budget_bytes=4 * MIB)
    with pytest.raises(ReplayMemoryError) as error:
        StepPlan.build(trees, memory=memory, lockstep_group=dist.group.WORLD)
    message = str(error.value)
    if rank == 1:
        assert "at its node of tokens [0, 2000) (2000 tokens, depth 1" in message, message
    else:
        assert message.startswith("rank 1 of the lock-step group cannot replay its part"), message
        assert "strategy=fsdp2" in message


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_rank_raises_when_one_rank_is_over_budget():
    run_distributed(_only_rank_1_over, 2)
