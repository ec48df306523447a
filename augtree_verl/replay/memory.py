"""The device memory one rank's replay of its one-device slots needs at its peak, checked against a budget
before the step's first model call (docs/design.md §9, *Memory*).

A trie runs depth first (``tree_run.TrieRun``): while node X runs, the rank holds the state of every node on
the root-to-X path (X included) plus one model call's working set. Per path node of n tokens, s of them
scored (``TrieNode.score_from``):

    resident = n kv                                   its K/V leaves (``PromptKV``; the live K/V's storage)
             + n kv_sum                               training: their float32 gradient sums (``grad_sum``)
             + n H e (s > 0) or H e                   the hidden states the delayed backward starts from
             + s V 4                                  training: the float32 tempered logits log-softmax saved
             + n saved                                training: what autograd saved for the delayed backward
                                                      (0 with offload where a boundary is worth moving)
    call     = max(n layer + s head,                  X's prefill (or its delayed backward's recompute)
                   max over X's leaf micro-batches of rows x longest row (padded, as ``micro_batches`` split
                   them) x (saved + layer) + scored x head)

and the peak is the largest (Σ path resident + call) over the trie's nodes X. Per-token bytes, from the model
config (``ModelShape``: L layers, H hidden, H_q / H_kv heads, query/key width D_k, value width D_v, I MLP width,
V vocab, e bytes per element of the dtype the layers compute in):

    kv     = L H_kv (D_k + D_v) e
    kv_sum = L H_kv (D_k + D_v) 4
    layer  = e (LAYER_HIDDEN H + LAYER_HEADS H_q D_k + H_kv (D_k + D_v) + LAYER_MLP I)   one decoder layer's saved
             activations (no checkpointing: every layer's until the backward; with it: the one layer that is
             recomputed at a time)
    saved  = (L + CHECKPOINT_EXTRA) H e    with checkpointing: each layer's input and the final norm's
             L layer - kv                 without: every layer's activations (a prompt's K/V counted once)
    head   = V (e + HEAD_FLOAT32 4)       training; forward only V (e + 4)
    forward only, the call's layer is  e (FORWARD_HIDDEN H + FORWARD_MLP I)  (nothing is saved)

A prompt with images runs the vision tower inside its prefill (``replay.vlm.ImagePrefill``; such a tree is alone in
its trie, on one device). Per image patch (``VisionShape``: d blocks of width W, MLP width M, h heads, m patch
mergers, pixel rows of C values; a, b: ``TOWER_BLOCK`` of its type) training adds to the root's resident, until the
delayed prompt backward,

    tower = e (C + TOWER_MERGER m W) + d (e (a W + b M) + 4 (h + TOWER_NORM_STATS))
            e (C + d W + TOWER_MERGER m W)   with checkpointing (HF's covers the tower's blocks: each one's input)

and forward only adds e (C + TOWER_FORWARD_HIDDEN W + TOWER_FORWARD_MLP M) to the root's call (nothing is held
after it). The tower's rotary tables, its output embeddings (the decoder's input) and, under checkpointing, a
block's recompute in the backward are not counted; nor is the tower in the planner's ``tree_peak`` (a tree with
images runs on one device whatever its plan).

Not counted: parameters, their gradients and optimizer state (the model's, allocated before the step and
the same for any schedule), FSDP2's unsharded parameter groups (one or two layers), the token ids and scores
(bytes per token, not per element), allocator fragmentation; ``device_budget_bytes`` leaves a margin for
them. Context-parallel trees (``cp_tree``) are not estimated: their state is sharded over their ring. A trie
with a context-parallel root over d members (``cp_trie``) counts, for its root, the whole K/V and sums every
member gathers plus its shard's (n / d of the root's saved activations, hidden states and live K/V), and its
prefill call at n / d tokens; below the root, as one device (every child, where a member runs a share: an
overestimate). A
hybrid's linear-attention layers are counted as attention layers (their fixed-size state is smaller: an
overestimate), an MoE layer as a dense MLP of the width a token's experts cost (``ModelShape.mlp_size``).

``check_memory`` (``StepPlan.build``'s ``memory``) raises ``ReplayMemoryError`` where the peak is over the
budget, naming the trie's trees, the node and its length, the estimate and the budget, and the ways out; over
a lock-step group every rank raises together (one int64 MAX all-reduce), so none waits in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from augtree_verl.groups import Tree
from augtree_verl.model_shape import ModelShape, VisionShape
from augtree_verl.replay.lockstep import CPTrieSlot, Slot, TrieSlot
from augtree_verl.replay.microbatch import split_micro_batches
from augtree_verl.replay.offload import MIN_OFFLOAD_BYTES
from augtree_verl.replay.trie import TrieNode

GIB = 1 << 30
FLOAT32_BYTES = 4  # gradient sums, tempered logits and their gradient are float32 whatever the model's dtype
# Elements a decoder layer saves for its backward per token (Qwen2/Llama, counted from transformers' code and
# checked by the measurement in tests/replay/test_memory.py): 6 H from the two RMSNorms (input, x * rsqrt,
# weight * that, each norm), 3 H_q D from attention (the rotated queries, the output, and the o_proj input's
# contiguous copy), H_kv (D_k + D_v) (the rotated keys and the values) and 4 I from the SwiGLU MLP (gate, silu(gate),
# up, their product).
LAYER_HIDDEN, LAYER_HEADS, LAYER_MLP = 6, 3, 4
# Without autograd a layer's largest moment: the residual and its normed copy, and the MLP's gate, up and
# silu(gate) at once.
FORWARD_HIDDEN, FORWARD_MLP = 2, 3
# Under checkpointing a prompt keeps each layer's input and, outside the checkpoints, the final norm's input and
# its normalised output (2 H more).
CHECKPOINT_EXTRA = 2
# Elements a vision tower's block saves for its backward per image patch, by the tower's ``model_type`` (counted from
# transformers' code and checked by tests/replay/test_tower_memory.py): of its width W, 7 from attention (the fused
# qkv output, which the values' view keeps whole, 3, the rotated queries and keys, the attention's output and the
# proj input's copy) and each norm's input and output (LayerNorm: 2 x 2), or also RMSNorm's x * rsqrt (Qwen2.5-VL:
# 2 x 3); of its MLP width M: Qwen2-VL's quick GELU 3 (fc1's output, its sigmoid, their product), Qwen2.5-VL's SwiGLU
# 4 (gate, silu(gate), up, their product), the others' GELU 2 (fc1's output and the GELU's).
TOWER_BLOCK = {
    "qwen2_vl_vision": (11, 3),
    "qwen2_5_vl_vision": (13, 4),
    **dict.fromkeys(("qwen3_vl_vision", "qwen3_vl_moe_vision", "qwen3_5_vision", "qwen3_5_moe_vision"), (11, 2)),
}
TOWER_BLOCK_OTHER = (13, 4)  # a tower of another type: the most of the above
# Float32 per patch and block beside them: the norms' statistics (mean and 1 / std, or 1 / rms) and, one per head,
# the attention's log-sum-exp.
TOWER_NORM_STATS = 4
# Per patch and patch merger (the output's, and Qwen3-VL's deepstack ones): its norm's input and output, its MLP's
# hidden and GELU output, W each (each merger's row is spatial_merge_size^2 patches of W).
TOWER_MERGER = 4
# Forward only, a block's largest moment: the residual, its normed copy and the fused qkv (5 W), counted with the
# MLP's hidden, activation and gate (3 M) though they are not alive at once.
TOWER_FORWARD_HIDDEN, TOWER_FORWARD_MLP = 5, 3
# Per scored token and vocabulary entry in a training call: the LM head's logits (e), the float32 tempered
# logits log-softmax saves and, in its backward, their float32 gradient and the gather's (3 x 4 bytes).
HEAD_FLOAT32 = 3
# What ``device_budget_bytes`` keeps back of the device's total memory, beyond the estimate: FSDP2's unsharded
# parameter and gradient buffers (a layer or two at once), NCCL and cuBLAS workspaces, allocator fragmentation.
SAFETY_FRACTION = 0.10
# The ways out of an over-budget step, in the order a user would try them.
WAYS_OUT = (
    "lower micro_batch_tokens (+actor_rollout_ref.actor.fsdp_config.micro_batch_tokens=...), turn on "
    "+actor_rollout_ref.actor.fsdp_config.offload_prompt_activations=True, plan the group context-parallel "
    "(cp_degrees with a degree > 1; a prefix several groups share then runs context-parallel as their trie's "
    "root), or train on verl's stock engine: "
)
# The setting that runs a refused model or step on verl's stock engine.
STOCK_ENGINE = (
    "actor_rollout_ref.actor.strategy=fsdp2 (and actor_rollout_ref.ref.strategy=fsdp2 for the reference model)"
)


class ReplayMemoryError(ValueError):
    """A step whose one-device replay would not fit in a rank's memory budget (``check_memory``)."""


@dataclass(frozen=True)
class ReplayMemory:
    """A model's per-token bytes (see the module docstring), how it runs and the budget to check against.

    ``kv``, ``kv_sum``, ``layer`` (forward only: the forward working set), ``saved``, ``head``: bytes per token
    (``head``: per scored token);
    ``hidden``: bytes of one hidden state [H]; ``dtype_bytes``: e; ``train``; ``budget_bytes``; ``offload``: the
    replay offloads prompt activations (``replay.offload``); ``tower``: bytes per image patch of the vision tower
    that a prompt with images runs in its prefill (training: what it keeps until the delayed prompt backward;
    forward only: its working set during the call; 0 without a tower)."""

    kv: int
    kv_sum: int
    layer: int
    saved: int
    head: int
    hidden: int
    dtype_bytes: int
    vocab: int
    train: bool
    budget_bytes: int
    offload: bool = False
    tower: int = 0

    @classmethod
    def of(
        cls, config, *, dtype: torch.dtype, checkpointing: bool, train: bool, budget_bytes: int, offload: bool = False
    ) -> ReplayMemory:
        """The sizes of a model (``config``: its Hugging Face config; ``dtype``: the dtype its layers compute
        in, e.g. FSDP2's ``param_dtype``; ``checkpointing``: activation checkpointing on) replayed in training
        (``train``) or forward only, checked against ``budget_bytes``; ``offload``: the training replay offloads
        prompt activations (``replay.offload``)."""
        return cls.of_shape(
            ModelShape.of(config),
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            checkpointing=checkpointing,
            train=train,
            budget_bytes=budget_bytes,
            offload=offload,
            vision=VisionShape.of(config),
        )

    @classmethod
    def of_shape(
        cls,
        shape: ModelShape,
        *,
        dtype_bytes: int,
        checkpointing: bool,
        train: bool,
        budget_bytes: int = 0,
        offload: bool = False,
        vision: VisionShape | None = None,
    ) -> ReplayMemory:
        """``of`` from a ``ModelShape`` (and ``vision``, its tower's) and e (``dtype_bytes``): the planner's cost
        model reads its per-token bytes from here, so the planner's memory filter and this guard are one model."""
        layers, hidden, heads, head_dim = shape.num_layers, shape.hidden_size, shape.num_heads, shape.head_dim
        e = dtype_bytes
        kv_width = layers * shape.kv_width
        mlp = shape.mlp_size
        layer = e * (LAYER_HIDDEN * hidden + LAYER_HEADS * heads * head_dim + shape.kv_width + LAYER_MLP * mlp)
        if not train:
            layer = e * (FORWARD_HIDDEN * hidden + FORWARD_MLP * mlp)
        return cls(
            kv=kv_width * e,
            kv_sum=kv_width * FLOAT32_BYTES,
            layer=layer,
            saved=(layers + CHECKPOINT_EXTRA) * hidden * e if checkpointing else layers * layer - kv_width * e,
            head=shape.vocab_size * (e + (HEAD_FLOAT32 if train else 1) * FLOAT32_BYTES),
            hidden=hidden * e,
            dtype_bytes=e,
            vocab=shape.vocab_size,
            train=train,
            budget_bytes=budget_bytes,
            offload=offload and train,
            tower=_tower_bytes(vision, e, checkpointing, train) if vision is not None else 0,
        )

    def resident(self, node: TrieNode, *, offload: bool, degree: int = 1) -> int:
        """Bytes ``node``'s state holds from its prefill to its delayed backward (the module docstring's
        resident); ``degree`` d > 1: a root run context-parallel over d members (this member's shard of n / d
        tokens, and the whole gathered K/V)."""
        return self.resident_bytes(node.length, _scored(node), offload=offload, degree=degree)

    def resident_bytes(self, n: int, scored: int, *, offload: bool, degree: int = 1) -> int:
        """``resident`` of a node of ``n`` tokens, ``scored`` of them scored."""
        shard = -(-n // degree)
        gathered = n * (self.kv + self.kv_sum if self.train else self.kv) if degree > 1 else 0
        if not self.train:
            return gathered + shard * self.kv + self.hidden
        total = gathered + shard * (self.kv + self.kv_sum) + (shard if scored else 1) * self.hidden
        total += scored * self.vocab * FLOAT32_BYTES
        # offload moves each saved boundary ([n, H]) worth a copy to the host
        if not (offload and shard * self.hidden >= MIN_OFFLOAD_BYTES):
            total += shard * self.saved
        return total

    def call(self, node: TrieNode, degree: int = 1) -> int:
        """Bytes of the largest single call while ``node`` is the deepest on the path: its prefill (``degree``
        d > 1: a context-parallel root's, n / d tokens) or one of its leaves' micro-batches (padded rows),
        working set and LM-head logits."""
        leaves = [leaf.length for leaf in node.leaves]
        return self.call_bytes(node.length, _scored(node), [[leaves[k] for k in b] for b in node.micro_batches], degree)

    def call_bytes(self, n: int, scored: int, micro_batches: Sequence[Sequence[int]], degree: int = 1) -> int:
        """``call`` of a node of ``n`` tokens, ``scored`` of them scored, its leaves' ``micro_batches`` given by
        their rows' lengths."""
        biggest = -(-n // degree) * self.layer + scored * self.head
        per_token = self.saved + self.layer if self.train else self.layer
        for lengths in micro_batches:
            padded = len(lengths) * max(max(lengths) - 1, 1)
            biggest = max(biggest, padded * per_token + sum(lengths) * self.head)
        return biggest

    def tree_peak(self, prompt: int, responses: Sequence[int], micro_batch_tokens: int, *, offload: bool) -> int:
        """``peak`` of one tree alone on one device, from its lengths: a prompt of ``prompt`` tokens (none
        scored: its last hidden state carries over to the leaves) and ``responses`` micro-batched as
        a trie's nodes are at ``micro_batch_tokens`` (``replay.trie.StepTrie``) (the planner's one-device memory,
        ``planner.cost.CostModel.one_device_memory``)."""
        batches = [[responses[i] for i in b] for b in split_micro_batches(list(responses), micro_batch_tokens)]
        return self.resident_bytes(prompt, 0, offload=offload) + self.call_bytes(prompt, 0, batches)

    def peak(self, root: TrieNode, *, offload: bool, degree: int = 1, patches: int = 0) -> tuple[int, list[TrieNode]]:
        """(peak bytes, the root-to-node path where it is reached) of replaying the trie ``root`` depth first
        (its ``micro_batches`` set, ``lockstep``); ``degree`` d > 1: its root context-parallel over d members;
        ``patches``: image patches its root's prefill runs through the vision tower (training: held until the
        root's delayed backward; forward only: in the root's call)."""
        tower = patches * self.tower
        best: tuple[int, list[TrieNode]] = (0, [root])
        stack = [(root, [root], self.resident(root, offload=offload, degree=degree) + (tower if self.train else 0))]
        while stack:
            node, path, held = stack.pop()
            call = self.call(node, degree if node is root else 1) + (tower if node is root and not self.train else 0)
            if held + call > best[0]:
                best = (held + call, path)
            for child in node.inner:
                stack.append((child, path + [child], held + self.resident(child, offload=offload)))
        return best


def _tower_bytes(vision: VisionShape, e: int, checkpointing: bool, train: bool) -> int:
    """Bytes per image patch of ``vision`` (``ReplayMemory.tower``): the tower's copy of the pixel row (which its
    patch embedding saves), then training each block's saved activations and the mergers' (with checkpointing each
    block's input instead), forward only one block's working set."""
    w, m = vision.width, vision.mlp_size
    if not train:
        return e * (vision.patch_dim + TOWER_FORWARD_HIDDEN * w + TOWER_FORWARD_MLP * m)
    mergers = vision.mergers * TOWER_MERGER * w
    if checkpointing:
        return e * (vision.patch_dim + vision.depth * w + mergers)
    hidden, mlp = TOWER_BLOCK.get(vision.model_type, TOWER_BLOCK_OTHER)
    block = e * (hidden * w + mlp * m) + FLOAT32_BYTES * (vision.heads + TOWER_NORM_STATS)
    return e * (vision.patch_dim + mergers) + vision.depth * block


def image_patches(root: TrieNode, trees: Sequence[Tree]) -> int:
    """Image patches of the trie ``root``'s trees (``trees``: the step's), which its root's prefill runs through
    the vision tower (a tree with images is alone in its trie)."""
    return sum(trees[t].vision.pixels.shape[0] for t in root.trees() if trees[t].vision is not None)


def _scored(node: TrieNode) -> int:
    return node.end - node.score_from if node.score_from is not None and node.children else 0


def device_budget_bytes(budget_gib: float | None, device: torch.device) -> int | None:
    """The replay's memory budget on ``device``: ``budget_gib`` GiB where given; else on CUDA what this
    process may still use (free device memory plus what torch's allocator has reserved and not allocated)
    less ``SAFETY_FRACTION`` of the device's memory; else (CPU) None: no check."""
    if budget_gib is not None:
        return int(budget_gib * GIB)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - int(SAFETY_FRACTION * total)


def check_memory(
    memory: ReplayMemory, slots: Sequence[Slot], trees: Sequence[Tree], *, group=None, device=None
) -> None:
    """Raise ``ReplayMemoryError`` where this rank's one-device slots (``lockstep_slots``') need more than
    ``memory.budget_bytes`` at their peak, naming the worst trie's trees, the node, its length, the estimate,
    the budget and the ways out. With ``group`` (the lock-step group) every rank calls this and all raise
    together: one int64 MAX all-reduce on ``device`` of (this rank + 1 where over, else 0); a rank under its
    budget names the rank that is over."""
    tries = [(s.node, s.degree, image_patches(s.node, trees)) for s in slots if isinstance(s, (TrieSlot, CPTrieSlot))]
    worst = max(
        (
            (*memory.peak(node, offload=memory.offload, degree=degree, patches=patches), node, patches)
            for node, degree, patches in tries
        ),
        key=lambda found: found[0],
        default=None,
    )
    over = worst is not None and worst[0] > memory.budget_bytes
    if group is None:
        if over:
            raise ReplayMemoryError(_message(memory, trees, *worst))
        return
    rank = torch.distributed.get_rank()
    flag = torch.tensor([rank + 1 if over else 0], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    if over:
        raise ReplayMemoryError(_message(memory, trees, *worst))
    if flag.item():
        raise ReplayMemoryError(
            f"rank {flag.item() - 1} of the lock-step group cannot replay its part of this step within its memory "
            f"budget (its error names the trie and the node); rank {rank} stops with it so that no rank waits in "
            f"a collective. Ways out: {WAYS_OUT}{STOCK_ENGINE}"
        )


def _message(
    memory: ReplayMemory, trees: Sequence[Tree], peak: int, path: list[TrieNode], root: TrieNode, patches: int
) -> str:
    node = path[-1]
    tower = (
        f", of which {_gib(patches * memory.tower)} the vision tower's activations for {patches} image patches "
        f"(fewer or smaller images, e.g. a lower max_pixels of the processor, or gradient checkpointing shrink it)"
        if patches * memory.tower
        else ""
    )
    names = [_tree_name(t, trees[t]) for t in root.trees()]
    shown = "; ".join(names[:4]) + (f"; and {len(names) - 4} more" if len(names) > 4 else "")
    mb = max((len(b) * max(node.leaves[k].length for k in b) for b in node.micro_batches), default=0)
    return (
        f"the replay of the trie of {shown} needs about {_gib(peak)} at its peak on this rank{tower}, over the "
        f"budget of {_gib(memory.budget_bytes)} (replay_memory_budget_gib): at its node of tokens "
        f"[{node.start}, {node.end}) ({node.length} tokens, depth {len(path)}), with the K/V and state of the "
        f"{sum(n.length for n in path)} tokens of its root-to-node path and its largest micro-batch of {mb} padded "
        f"tokens. Ways out: {WAYS_OUT}{STOCK_ENGINE}"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def _tree_name(t: int, tree: Tree) -> str:
    if not tree.uid and not tree.samples:
        return f"tree {t}"
    samples = list(tree.samples[:8]) + (["..."] if len(tree.samples) > 8 else [])
    return f"tree {t} (uid {tree.uid!r}, samples {samples})"
