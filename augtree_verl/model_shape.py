"""``ModelShape``: the sizes of a decoder-only model that the planner, the memory guard, the CP byte formulas and
the FLOP counts read, taken from a Hugging Face config in one place.

Configs name their sizes differently, and some lack the usual ones (multi-head latent attention has a query/key
width ``qk_head_dim`` and another value width ``v_head_dim``, and its ``head_dim`` is the rope part; LongCat-Flash
and OPT have no ``intermediate_size``; MoE layers run ``num_experts_per_tok`` experts of
``moe_intermediate_size``). ``ModelShape.of(config)`` reads every size through the names below, never assuming an
attribute exists, and raises a ``ValueError`` naming the config and the size it cannot find where a size the
replay needs (layers, hidden size, heads, vocabulary) has no name it knows. The MLP width is an estimate for
costs and memory only (nothing exact depends on it): where no name it knows is set, 4 x hidden.

``VisionShape.of(config)``: the sizes of a vision-language config's vision tower (``config.vision_config``; None
without one) that the memory guard reads, the same way: Qwen2-VL's tower names its block width ``embed_dim`` (its
``hidden_size`` is the merger's output, the LLM's width) and its MLP ``mlp_ratio`` x width; Qwen2.5-VL's,
Qwen3-VL's and Qwen3.5's ``hidden_size`` and ``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

# The config names of each size, first found wins.
LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
HIDDEN = ("hidden_size", "n_embd", "d_model")
HEADS = ("num_attention_heads", "n_head")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
# The query/key width: MLA's ``qk_head_dim``, else the sum of its two parts (DeepSeek-V2 names no ``qk_head_dim``),
# and only then ``head_dim`` (MLA's ``head_dim`` is its rope part).
QK_HEAD_DIM = ("qk_head_dim",)
QK_PARTS = ("qk_nope_head_dim", "qk_rope_head_dim")
HEAD_DIM = ("head_dim",)
V_HEAD_DIM = ("v_head_dim",)
DENSE_MLP = ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner")
EXPERT_MLP = ("moe_intermediate_size", "expert_ffn_hidden_size")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk")
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts")
SHARED_EXPERT_MLP = ("shared_expert_intermediate_size",)
# Gated DeltaNet's sizes (Qwen3.5, Qwen3-Next), read only where ``layer_types`` lists a linear-attention layer.
LINEAR_SIZES = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
MLP_FALLBACK_FACTOR = 4  # GPT-2's and OPT's convention, where a config names no MLP width
# A vision tower's sizes: the block width (Qwen2-VL's ``embed_dim`` first: its ``hidden_size`` is the LLM's), the MLP
# width, or else its ratio to the block width (Qwen2-VL), and what makes a patch's pixel row (C x T x P^2 values).
TOWER_DEPTH = ("depth", "num_hidden_layers")
TOWER_WIDTH = ("embed_dim", "hidden_size")
TOWER_MLP = ("intermediate_size",)
TOWER_MLP_RATIO = "mlp_ratio"  # a float in some configs: int(ratio x width), as Qwen2-VL's block computes it
TOWER_HEADS = ("num_heads", "num_attention_heads")
PATCH_SIZES = ("in_channels", "temporal_patch_size", "patch_size")
DEEPSTACK = "deepstack_visual_indexes"  # Qwen3-VL(-MoE): the blocks whose outputs an extra merger injects


def text_config(config):
    """The decoder's config of a (possibly multimodal) Hugging Face config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _first(config, names: tuple[str, ...], minimum: int = 1) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
    return None


@dataclass(frozen=True)
class ModelShape:
    """Per layer: ``num_heads`` query heads of width ``head_dim`` (D_k, also the keys'), ``num_kv_heads`` key/value
    heads (values of width ``value_head_dim``, D_v), an MLP of ``mlp_size`` (the width a token's MLP pass costs:
    dense, or the routed plus shared experts of an MoE layer); ``linear_layers``: layers of linear attention
    (``config.layer_types``), which hold a recurrent state instead of K/V, with ``linear_key_heads`` H_k key and
    ``linear_heads`` H_v value heads of widths ``linear_key_dim`` D_k and ``linear_value_dim`` D_v and a causal
    conv of ``linear_conv_kernel`` K (all 0 without linear layers)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    mlp_size: int
    vocab_size: int
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0

    @classmethod
    def of(cls, config) -> ModelShape:
        """The shape of ``config`` (a Hugging Face config, or a multimodal one: its text config); ``ValueError``
        naming the model type and the size where layers, hidden size, heads or vocabulary have no known name."""
        config = text_config(config)
        model_type = getattr(config, "model_type", None) or type(config).__name__
        sizes = {}
        for what, names in (("layers", LAYERS), ("hidden size", HIDDEN), ("heads", HEADS), ("vocab", ("vocab_size",))):
            sizes[what] = _first(config, names)
            if sizes[what] is None:
                raise ValueError(
                    f"config of model {model_type!r} has no {what} under a name augtree knows ({', '.join(names)})"
                )
        layers, hidden, heads = sizes["layers"], sizes["hidden size"], sizes["heads"]
        head_dim = _first(config, QK_HEAD_DIM) or _qk_parts(config) or _first(config, HEAD_DIM) or hidden // heads
        layer_types = getattr(config, "layer_types", None) or ()
        linear_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention")
        linear = {}
        if linear_layers:
            linear = {name: _first(config, (name,)) for name in LINEAR_SIZES}
            missing = [name for name, value in linear.items() if value is None]
            if missing:
                raise ValueError(
                    f"config of model {model_type!r} has linear-attention layers but no {', '.join(missing)}"
                )
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=_first(config, KV_HEADS) or heads,
            head_dim=head_dim,
            value_head_dim=_first(config, V_HEAD_DIM) or head_dim,
            mlp_size=_mlp_size(config, hidden),
            vocab_size=sizes["vocab"],
            linear_layers=linear_layers,
            linear_key_heads=linear.get("linear_num_key_heads") or 0,
            linear_heads=linear.get("linear_num_value_heads") or 0,
            linear_key_dim=linear.get("linear_key_head_dim") or 0,
            linear_value_dim=linear.get("linear_value_head_dim") or 0,
            linear_conv_kernel=linear.get("linear_conv_kernel_dim") or 0,
        )

    @property
    def kv_width(self) -> int:
        """Elements of one token's K and V in one attention layer: H_kv (D_k + D_v)."""
        return self.num_kv_heads * (self.head_dim + self.value_head_dim)

    @property
    def linear_conv_dim(self) -> int:
        """Pre-conv channels of a linear-attention layer: 2 H_k D_k + H_v D_v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_heads * self.linear_value_dim

    @property
    def attention_layers(self) -> int:
        """Layers that keep K/V (all but the linear-attention ones)."""
        return self.num_layers - len(self.linear_layers)

    @property
    def linear_flops(self) -> int:
        """Forward FLOPs per token of the projections (Q, K, V, output) and the MLP (SwiGLU: 3 matrices), all
        layers."""
        h, q = self.hidden_size, self.num_heads
        projections = h * (q * self.head_dim + self.kv_width) + q * self.value_head_dim * h
        return self.num_layers * 2 * (projections + 3 * h * self.mlp_size)

    @property
    def attention_pair_flops(self) -> int:
        """Forward FLOPs per (query, key) pair, all layers: QK^T (2 H_q D_k) and PV (2 H_q D_v)."""
        return self.num_layers * 2 * self.num_heads * (self.head_dim + self.value_head_dim)

    @property
    def head_flops(self) -> int:
        """Forward FLOPs of the LM head per scored token."""
        return 2 * self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class VisionShape:
    """A vision tower of ``depth`` blocks of width ``width`` (W), an MLP of ``mlp_size`` (M) and ``heads`` attention
    heads, on patches of ``patch_dim`` values (``pixel_values`` [patches, patch_dim]); ``mergers``: its patch
    mergers (the output's and Qwen3-VL's deepstack ones)."""

    model_type: str
    depth: int
    width: int
    mlp_size: int
    heads: int
    patch_dim: int
    mergers: int

    @classmethod
    def of(cls, config) -> VisionShape | None:
        """The tower of ``config`` (a vision-language Hugging Face config: its ``vision_config``), None without one;
        ``ValueError`` naming the model type and the size where a size has no known name."""
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        model_type = getattr(vision, "model_type", None) or type(vision).__name__
        sizes = {}
        for what, names in (
            ("vision depth", TOWER_DEPTH),
            ("vision width", TOWER_WIDTH),
            ("vision heads", TOWER_HEADS),
            *((f"vision {name}", (name,)) for name in PATCH_SIZES),
        ):
            sizes[what] = _first(vision, names)
            if sizes[what] is None:
                raise ValueError(
                    f"vision config of model {model_type!r} has no {what} under a name augtree knows "
                    f"({', '.join(names)})"
                )
        width, ratio = sizes["vision width"], getattr(vision, TOWER_MLP_RATIO, None)
        ratio = ratio if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 0 else None
        mlp = _first(vision, TOWER_MLP) or (int(width * ratio) if ratio is not None else None)
        if mlp is None:
            raise ValueError(
                f"vision config of model {model_type!r} has no vision MLP size under a name augtree knows "
                f"({', '.join((*TOWER_MLP, TOWER_MLP_RATIO))})"
            )
        channels, frames, patch = (sizes[f"vision {name}"] for name in PATCH_SIZES)
        return cls(
            model_type=model_type,
            depth=sizes["vision depth"],
            width=width,
            mlp_size=mlp,
            heads=sizes["vision heads"],
            patch_dim=channels * frames * patch**2,
            mergers=1 + len(getattr(vision, DEEPSTACK, None) or ()),
        )


def _qk_parts(config) -> int | None:
    """qk_nope_head_dim + qk_rope_head_dim where a config names both (multi-head latent attention), else None."""
    nope, rope = (_first(config, (name,), minimum=0) for name in QK_PARTS)
    return nope + rope if nope is not None and rope is not None and nope + rope > 0 else None


def _mlp_size(config, hidden: int) -> int:
    expert, per_token = _first(config, EXPERT_MLP), _first(config, EXPERTS_PER_TOKEN)
    if expert is not None and per_token is not None:
        shared = _first(config, SHARED_EXPERT_MLP) or expert * (_first(config, SHARED_EXPERTS) or 0)
        return expert * per_token + shared
    dense = _first(config, DENSE_MLP, minimum=0)
    return dense if dense is not None else MLP_FALLBACK_FACTOR * hidden
