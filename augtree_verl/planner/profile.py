"""The cluster profile: what the planner's cost model knows about the hardware and the model.

Hardware figures are per rank (one accelerator). ``default()`` describes an 8-GPU H100 SXM node training a
Qwen2.5-7B-shaped model; ``calibrate()`` replaces the hardware figures with numbers measured on the
current device and process group, on the profile's model shapes (call ``with_model`` first); ``save``/``load``
keep a profile as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from augtree_verl.model_shape import ModelShape

_POSITIVE_FLOATS = (
    "flops_per_s",
    "attention_flops_per_s",
    "causal_attention_flops_per_s",
    "p2p_bytes_per_s",
    "collective_bytes_per_s",
    "internode_bytes_per_s",
    "launch_latency_s",
    "ring_hop_s",
    "all_to_all_s",
    "call_overhead_s",
    "slot_overhead_s",
    "memory_per_rank_bytes",
)
_POSITIVE_INTS = (
    "ranks_per_node",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "value_head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "dtype_bytes",
)
# A hybrid's linear-attention sizes (``ModelShape``'s), 0 for a model without linear-attention layers.
LINEAR_FIELDS = (
    "linear_layers",
    "linear_key_heads",
    "linear_heads",
    "linear_key_dim",
    "linear_value_dim",
    "linear_conv_kernel",
)
# What a profile says about the model and how it trains (the rest is hardware and policy): a saved profile
# applies to a run only when these match (``planner.startup``).
MODEL_FIELDS = (
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "value_head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "dtype_bytes",
    "activation_checkpointing",
    *LINEAR_FIELDS,
)


@dataclass(frozen=True, kw_only=True)
class ClusterProfile:
    # --- hardware, per rank ---
    flops_per_s: float  # achieved dense matmul throughput (FLOP/s) in the training dtype
    attention_flops_per_s: float  # achieved attention-kernel throughput (forward + backward FLOP/s)
    causal_attention_flops_per_s: float  # the same for causal blocks, FLOPs of the visible half counted
    p2p_bytes_per_s: float  # point-to-point bandwidth to a neighbour inside a node, one direction
    collective_bytes_per_s: float  # per-rank bandwidth of the all-to-all MoveQ uses, inside a node
    internode_bytes_per_s: float  # per-rank bandwidth once a group spans nodes (p2p and collectives)
    # Fixed costs of context-parallel replay (calibrate() fits them on the CP group's own replay):
    launch_latency_s: float  # a CP step's score exchange among its ranks, and what the step adds around it
    ring_hop_s: float  # one K/V ring step of one layer: a P2P shift, a block's attention and merge
    all_to_all_s: float  # one of MoveQ's all-to-alls of one layer, with the owners' attention it feeds
    call_overhead_s: float  # one response call (decoder, LM head, loss, backward) beyond its FLOPs
    slot_overhead_s: float  # one tree beyond its FLOPs: its prefill call and delayed prompt backward
    memory_per_rank_bytes: float  # what replay may use: activations, prompt K/V, comm buffers, outputs
    ranks_per_node: int  # groups larger than this must span whole nodes
    # --- model shape ---
    num_layers: int
    num_heads: int  # query heads H_q
    num_kv_heads: int  # key/value heads H_kv (GQA: H_q % H_kv == 0)
    head_dim: int  # query/key head width D_k
    value_head_dim: int  # value head width D_v (multi-head latent attention: not D_k)
    hidden_size: int
    intermediate_size: int  # the MLP width a token's pass costs (``ModelShape.mlp_size``)
    vocab_size: int
    dtype_bytes: int = 2  # bf16 activations and communication
    activation_checkpointing: bool = True
    # A hybrid's Gated DeltaNet layers (``ModelShape``'s linear sizes; 0 without them): how many, H_k key and H_v
    # value heads of widths D_k and D_v, conv kernel K. The state scan's bytes (planner/cost.py) read them.
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Policy: a plan on d ranks is admissible only if it keeps this fraction of ideal scaling relative to
    # the best plan on the smallest degree that fits in memory (see planner/search.py). 0 = pure fastest.
    min_parallel_efficiency: float = 0.8

    def __post_init__(self):
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ClusterProfile.{name} must be a positive finite number, got {value!r}")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterProfile.{name} must be a positive int, got {value!r}")
        for name in LINEAR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ClusterProfile.{name} must be an int >= 0, got {value!r}")
        if self.linear_layers >= self.num_layers:
            raise ValueError(
                f"ClusterProfile.linear_layers={self.linear_layers} must leave an attention layer of "
                f"num_layers={self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ClusterProfile.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"ClusterProfile.activation_checkpointing must be a bool, got {self.activation_checkpointing!r}"
            )
        eff = self.min_parallel_efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0.0 <= eff <= 1.0:
            raise ValueError(f"ClusterProfile.min_parallel_efficiency must be in [0, 1], got {eff!r}")

    @classmethod
    def default(cls) -> ClusterProfile:
        """An 8 x H100 SXM node (HGX/DGX H100) training a Qwen2.5-7B-shaped model in bf16.

        Sources (an H200 has the same compute and NVLink, 141 GB and 4.8 TB/s HBM3e):
        - flops: NVIDIA H100 Tensor Core GPU datasheet, SXM dense BF16 989 TFLOPS (1,979 is with
          sparsity); we assume 60% of it is reached by the replay's GEMMs and flash attention.
        - p2p: 4th-gen NVLink, 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional per the
          datasheet); we assume 80% (360 GB/s) for large send/recv.
        - collectives: all-to-all and all-gather through NVSwitch reach less than a single p2p stream;
          we assume 250 GB/s per rank (nccl-tests class figure; calibrate() measures the real one).
        - internode: one 400 Gb/s ConnectX-7 NDR InfiniBand port per GPU in DGX H100 = 50 GB/s; 90% usable.
        - attention: FlashAttention-2 forward + backward in bf16 on H100 SXM reaches about 35% of dense peak
          at head dim 128 (FlashAttention-3 paper, Shah et al. 2024, H100 benchmarks: ~300-350 TFLOPS);
          causal blocks somewhat less (the diagonal tiles are partly masked): we assume 30%.
        - latency, ring hop, all-to-all: ~10 us for a small NCCL step inside a node.
        - call and slot overheads: a decoder layer's forward + backward launches ~36 kernels at ~10 us of host
          time each (eager PyTorch), for 28 layers, per response call and per tree (prefill and delayed
          backward); they only matter for short steps.
        - memory: 80 GB HBM3, minus a 7.6B model's FSDP-sharded bf16 weights, fp32 grads and Adam states
          (~16 B/param / 8 ranks ~ 15 GB) and ~15 GB for CUDA context, NCCL buffers and fragmentation.
        - model: Qwen2.5-7B-Instruct config.json (28 layers, 28 heads, 4 KV heads, hidden 3584,
          intermediate 18944, vocab 152064; head_dim = 3584 / 28 = 128).
        """
        return cls(
            flops_per_s=0.6 * 989e12,
            attention_flops_per_s=0.35 * 989e12,
            causal_attention_flops_per_s=0.3 * 989e12,
            p2p_bytes_per_s=360e9,
            collective_bytes_per_s=250e9,
            internode_bytes_per_s=45e9,
            launch_latency_s=10e-6,
            ring_hop_s=10e-6,
            all_to_all_s=10e-6,
            call_overhead_s=28 * 36 * 10e-6,
            slot_overhead_s=28 * 36 * 10e-6,
            memory_per_rank_bytes=50e9,
            ranks_per_node=8,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            value_head_dim=128,
            hidden_size=3584,
            intermediate_size=18944,
            vocab_size=152064,
        )

    # ---- the model's FLOP counts (forward, all layers; planner/cost.py's lin, head and attn) ----------
    @property
    def shape(self) -> ModelShape:
        """The model's shape (``model_shape.ModelShape``: the one place its FLOPs are counted)."""
        return ModelShape(
            model_type="profile",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            value_head_dim=self.value_head_dim,
            mlp_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            linear_layers=tuple(range(self.linear_layers)),  # which layers does not matter to a cost
            linear_key_heads=self.linear_key_heads,
            linear_heads=self.linear_heads,
            linear_key_dim=self.linear_key_dim,
            linear_value_dim=self.linear_value_dim,
            linear_conv_kernel=self.linear_conv_kernel,
        )

    @property
    def linear_flops(self) -> int:
        """Per token: QKV and output projections, SwiGLU MLP."""
        return self.shape.linear_flops

    @property
    def head_flops(self) -> int:
        """Per scored token: the LM head."""
        return self.shape.head_flops

    @property
    def attention_pair_flops(self) -> int:
        """Per (query, key) pair: QK^T and PV."""
        return self.shape.attention_pair_flops

    @property
    def train_factor(self) -> int:
        """Training FLOPs over forward FLOPs: backward = 2 x forward, plus the recompute under checkpointing."""
        return (2 if self.activation_checkpointing else 1) + 2

    def with_model(self, config) -> ClusterProfile:
        """This profile with the model shape read from a Hugging Face config (``model_shape.ModelShape.of``)."""
        shape = ModelShape.of(config)
        return dataclasses.replace(
            self,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            value_head_dim=shape.value_head_dim,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.mlp_size,
            vocab_size=shape.vocab_size,
            linear_layers=len(shape.linear_layers),
            linear_key_heads=shape.linear_key_heads,
            linear_heads=shape.linear_heads,
            linear_key_dim=shape.linear_key_dim,
            linear_value_dim=shape.linear_value_dim,
            linear_conv_kernel=shape.linear_conv_kernel,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ClusterProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ClusterProfile has no field(s) {unknown}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(
                f"ClusterProfile needs the field(s) {missing} (a profile saved by an earlier "
                f"version: calibrate it again)"
            )
        return cls(**d)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path) -> ClusterProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))
