"""Shared parity helpers for tests: tiny models built from configs and a relative-error metric."""

from __future__ import annotations

import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from augtree_verl import ReplayOptions, Tree

# float32 on CPU: the grouped schedule sums the same terms in another order (prompt adjoints accumulated
# over micro-batches, attention over [prompt ; response] split differently), so results differ by rounding
# only. 1e-5 of the tensor's largest magnitude is ~100x the float32 epsilon and far below any real bug.
RTOL = 1e-5

VOCAB = 256
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen2-gqa": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen3-gqa": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}


def tiny_model(name: str = "qwen2-gqa", seed: int = 0):
    config_cls, model_cls, heads = MODELS[name]
    torch.manual_seed(seed)
    config = config_cls(**_SHAPE, **heads, attn_implementation="sdpa")
    return model_cls(config).float().train()


def random_trees(prompt_lens, response_lens, seed: int = 0, vocab: int = VOCAB) -> list[Tree]:
    """``response_lens[t]`` lists the response lengths of tree t; token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g)
    return [Tree.of_tokens(ids(p), [ids(r) for r in rs]) for p, rs in zip(prompt_lens, response_lens)]


OPTION_KEYS = frozenset(f.name for f in dataclasses.fields(ReplayOptions))


def plan_and_options(kw: dict) -> tuple[dict, ReplayOptions]:
    """A test's keyword arguments split into ``StepPlan.build``'s and the ``ReplayOptions`` of the run."""
    return {k: v for k, v in kw.items() if k not in OPTION_KEYS}, ReplayOptions(
        **{k: v for k, v in kw.items() if k in OPTION_KEYS}
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def grads(model) -> dict[str, torch.Tensor]:
    """The parameters' gradients, where they have one (frozen ones, e.g. a LoRA model's base weights, have none, nor
    does a vision-language model's vision tower on text-only rows: its forward never calls it)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match(got: dict, want: dict, rtol: float = RTOL) -> None:
    assert got.keys() == want.keys()
    live = [n for n in want if want[n].abs().max() > 0]
    # Some gradients are exactly zero by the math (e.g. q_proj when every sequence has one token); most
    # must not be, or the comparison could not see a bug.
    assert len(live) > len(want) // 2, f"only {len(live)}/{len(want)} reference gradients are non-zero"
    for n in want:
        err = rel_err(got[n], want[n])
        assert err <= rtol, f"grad of {n}: relative error {err:.2e} > {rtol:.0e}"


def assert_logps_match(got, want, rtol: float = RTOL) -> None:
    assert len(got) == len(want)
    for t, (rg, rw) in enumerate(zip(got, want)):
        assert len(rg) == len(rw)
        for i, (a, b) in enumerate(zip(rg, rw)):
            assert a.dtype == torch.float32 and a.shape == b.shape, (t, i, a.dtype, a.shape, b.shape)
            err = rel_err(a, b)
            assert err <= rtol, f"log-probs of tree {t} response {i}: relative error {err:.2e}"
