"""GPU check (issue 15): the CUDA path on plain CUDA torch, one line per check and a final PASS/FAIL.

    python benchmarks/gpu_check.py [--json out.json]     # one CUDA GPU: CUDA torch + transformers + this package
    python benchmarks/gpu_check.py --cpu-smoke           # the same checks on CPU, small shapes

Needs only torch, transformers and augtree_verl (``pip install --no-deps -e .``): no verl, ray, tensordict
or flash-attn (``AUGTREE_ATTENTION_BACKEND=flash_attn`` checks that backend instead of torch's own).
The device under test runs bfloat16; every reference runs float32 (TF32 off) on the same device and the same
bf16-rounded inputs, so only the bf16 kernels' arithmetic is compared.

Checks (sizes on a GPU; ``--cpu-smoke`` shrinks every one):
 1. ``ops.attention`` forward (out, lse) and backward (dq, dk, dv) vs float32 attention: head layouts
    (28 q, 4 kv), (40, 8), (32, 32) x head dims 64, 128 x {causal 777 x 777, full 513 x 2049, single-query
    GQA 1 x 3001}; one 4096 x 16384 block (28/4, d 128); a merge of 3 partial states (1024 x 3000) with its
    merged-state backward. Multi-head latent attention, the value width D_v apart from the query/key width D_k
    (the kernels run padded to max(D_k, D_v), ``ops.head_pad``): 32/32 heads of D_k 192, D_v 128 (DeepSeek-V3's)
    and of D_k 64, D_v 128, each on the three block kinds and a merge of 3 with its merged-state backward.
 2. prefix attention (``replay.prefix_attention``): 4 ragged rows against a 1500-token prompt, out and every
    gradient, prompt K/V included.
 3. ``replay()`` on a 2-layer Qwen2.5-7B-shaped model (hidden 3584, 28/4 heads of 128, vocab 152,064; 1.5B
    parameters) in bf16 vs the float32 flattened baseline: log-probs and the gradient, next to the bf16
    flattened baseline's error against the same reference (ours may be at most ``SLACK`` times worse).
 4. the CP tree run (``replay.cp_tree``) of ring, tree_move_kv and move_q plans on a one-rank NCCL group
    (rings of one member: the CP kernels, merges and exchanges on one GPU): the same comparison.
 5. peak memory of a 32,000-token bf16 prefill (forward only): must stay far below one layer's score
    matrix (28 x 32k^2 bf16 = 56 GiB), i.e. the flash kernel ran, not the quadratic one.
 6. host syncs (``torch.cuda.set_sync_debug_mode``): a forward-only replay syncs once per tree (the token-id
    range check); a training replay at most that plus what the flattened baseline's own backward costs.
 7. INFO: paired speed ratio (median of back-to-back ratios) of replay vs flattened, one training step, on a
    prompt-heavy (16384 / 8 x 256) and a response-heavy (512 / 8 x 4096) group.
 8. prompt-activation offload (``replay.offload``) on one long-prompt group (16384 / 4 x 128, the model of 3
    without checkpointing, so every prompt activation is saved and moves): training step with and without
    offload, log-probs and gradient must agree (tolerance ``OPS_RTOL``: the copies are exact, CUDA's atomics
    may order sums differently), peak CUDA memory above the weights (``max_memory_allocated``) must drop,
    and a step must make no more host syncs than without offload; the line gives both peaks, the step-time
    cost (median of paired ratios; an upper bound: two layers without checkpointing save far more bytes per
    FLOP than 28 checkpointed layers, so less of the copying hides behind compute) and the prefetched share.
 9. a hybrid Gated DeltaNet model (2 layers of a Qwen3.5 shape: one linear-attention, one full-attention;
    ``replay.linear_state``) in bf16 vs the float32 flattened baseline, as in 3; the line names the delta-rule
    kernel the layer runs (flash-linear-attention's ``chunk_gated_delta_rule`` when installed, else the torch
    fallback).
10. that hybrid through the CP tree run on a one-rank NCCL group, as in 4: the linear layer's state scan
    (``cp.state_scan``: its rows, chunk summaries, the conv from a given window, the delta-rule kernel from a
    given initial state, forward and backward) with one member; one line, the worst of ring, tree_move_kv and
    move_q.
11. a vision-language model (Qwen2.5-VL: 2 text layers of check 3's shape under M-RoPE, a 2-block vision tower of
    Qwen2.5-VL-7B's width) on prompts with an image each (1,024 and 384 patches) and a text prompt, in bf16 vs the
    float32 flattened baseline (each [prompt || response] run with its image), as in 3, the tower's gradient
    included; and the tower's forward runs once per image tree in a training step (the flattened baseline: once per
    row).
Expected on one H200: about 2 minutes, peak about 45 GiB (the float32 reference of the 4k x 16k block).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from augtree_verl import Plan, ReplayOptions, ReplayStats, StepPlan, Tree, per_response, replay
from augtree_verl.groups import Vision
from augtree_verl.ops.attention import attention_backward, attention_forward, cuda_backend_name
from augtree_verl.ops.merge import empty_state, merge_into
from augtree_verl.replay.baseline import flattened_replay
from augtree_verl.replay.offload import Offload
from augtree_verl.replay.prefix_attention import prefix_causal_attention
from augtree_verl.replay.rope import RopeRegimes

# bf16 kernel vs float32 reference, max |got - ref| / max |ref| per tensor: bf16 keeps 8 mantissa bits
# (2^-8 = 3.9e-3 per rounding) and flash kernels also round P to bf16 before P V, so a few ulps.
OPS_RTOL = 2e-2
# replay in bf16 may be at most this many times further from the float32 reference than the
# bf16 flattened baseline is (both round the same GEMMs to bf16, in another grouping), and errors below
# ERR_FLOOR pass regardless (they are at float32 noise level, where a ratio means nothing).
SLACK = 2.0
ERR_FLOOR = 1e-4

QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Qwen3.5-9B-like layer shapes (hidden 4096, Gated DeltaNet 16 key / 32 value heads of 128, attention 16 / 4
# heads of 256), vocabulary cut to Qwen2.5's
QWEN35_SHAPE = dict(
    vocab_size=152064,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Sizes:
    heads: tuple  # (q heads, kv heads) layouts
    dims: tuple  # head dims
    blocks: tuple  # (Sq, Sk, causal) per op case
    big_block: tuple  # (Sq, Sk) of the long block, first layout, largest dim
    merge: tuple  # (Sq, Sk) split into 3 key blocks
    prefix: tuple  # (P, ragged response lengths)
    model: dict
    layers: int
    trees: tuple  # (P, response lengths) per tree for the replay checks
    prefill: int  # prompt tokens of the memory check
    speed: dict  # name -> (P, R, G)
    repeats: int
    hybrid: dict  # the hybrid check's model shape (check 9)
    mla: tuple  # (H = H_kv, (D_k, D_v) pairs): multi-head latent attention, K/V expanded to every query head
    vision: dict  # the vision check's tower (Qwen2.5-VL vision config) and M-RoPE sections
    images: tuple  # (text before, (t, h, w) patch grid or None, text after, response lengths) per tree


GPU = Sizes(
    heads=((28, 4), (40, 8), (32, 32)),
    dims=(64, 128),
    blocks=((777, 777, True), (513, 2049, False), (1, 3001, False)),
    big_block=(4096, 16384),
    merge=(1024, 3000),
    prefix=(1500, (257, 100, 31, 2)),
    model=QWEN25_7B,
    layers=2,
    trees=((1024, (200, 64, 129, 17)), (333, (50, 300))),
    prefill=32000,
    speed={"prompt-heavy": (16384, 256, 8), "response-heavy": (512, 4096, 8)},
    repeats=3,
    hybrid=QWEN35_SHAPE,
    mla=(32, ((192, 128), (64, 128))),
    # Qwen2.5-VL-7B's tower width (1280, 16 heads, 14 x 14 patches, 2 x 2 merge), 2 of its 32 blocks
    vision=dict(
        tower=dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[1]),
        mrope_section=[16, 24, 24],
    ),
    images=((20, (1, 32, 32), 30, (200, 64, 129, 17)), (9, (1, 16, 24), 4, (50, 300)), (333, None, 0, (40, 8))),
)
SMOKE = Sizes(
    heads=((4, 2), (4, 4)),
    dims=(16,),
    blocks=((37, 37, True), (21, 70, False), (1, 45, False)),
    big_block=(64, 256),
    merge=(24, 60),
    prefix=(40, (9, 4, 1, 2)),
    model=TINY,
    layers=2,
    trees=((24, (7, 3, 5, 1)), (9, (4, 6))),
    prefill=512,
    speed={"prompt-heavy": (128, 8, 2), "response-heavy": (8, 48, 2)},
    repeats=1,
    hybrid=dict(
        TINY,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    mla=(4, ((24, 16), (8, 16))),
    vision=dict(
        tower=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=2, fullatt_block_indexes=[0]),
        mrope_section=[4, 2, 2],
    ),
    images=((3, (1, 4, 4), 2, (7, 3, 5, 1)), (2, (1, 2, 4), 3, (4, 6)), (9, None, 0, (4, 2))),
)


class Report:
    """One line per check: PASS / FAIL / INFO / SKIP, then the verdict."""

    def __init__(self):
        self.rows = []

    def add(self, status: str, name: str, detail: str) -> None:
        self.rows.append(dict(status=status, check=name, detail=detail))
        print(f"{status:4}  {name:44} {detail}", flush=True)

    def check(self, ok: bool, name: str, detail: str) -> None:
        self.add("PASS" if ok else "FAIL", name, detail)

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.rows if r["status"] == "FAIL"]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / (scale or 1.0)


def fmt(errs: dict) -> str:
    return " ".join(f"{k} {v:.1e}" for k, v in errs.items())


# ---- 1. ops ---------------------------------------------------------------------------------------------


def reference_attention(q, k, v, scale, visible):
    """float32 softmax attention with GQA heads repeated: q [H, n, D_k], k [H_kv, m, D_k], v [H_kv, m, D_v],
    visible [n, m] -> out [H, n, D_v], lse [H, n]."""
    rep = q.shape[0] // k.shape[0]
    s = (q @ k.repeat_interleave(rep, 0).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(rep, 0), torch.logsumexp(s, -1)


def random_block(h, hk, sq, sk, d, device, g, dv=None):
    """bf16-rounded q, k [.., d], v, dout [.., dv] (default d) on ``device``: (bf16 tensors, float32 copies of the
    same values)."""
    dv = dv or d
    xs = [
        torch.randn(n, s, w, generator=g) * c
        for n, s, w, c in ((h, sq, d, 0.5), (hk, sk, d, 0.5), (hk, sk, dv, 1.0), (h, sq, dv, 1.0))
    ]
    low = [x.to(device, torch.bfloat16) for x in xs]
    return low, [x.float() for x in low]


def reference_block(q, k, v, dout, scale, visible):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q, k, v, scale, visible)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def check_op_block(report, name, h, hk, sq, sk, d, causal, device, g, dv=None):
    (q, k, v, dout), ref_in = random_block(h, hk, sq, sk, d, device, g, dv)
    scale = d**-0.5
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        visible = visible.tril()
    want = reference_block(*ref_in, scale, visible)
    out, lse = attention_forward(q, k, v, causal=causal, scale=scale)
    got = (out, lse, *attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale))
    errs = dict(zip(("out", "lse", "dq", "dk", "dv"), (rel(a, b) for a, b in zip(got, want))))
    report.check(max(errs.values()) <= OPS_RTOL, name, fmt(errs) + f" (tol {OPS_RTOL})")


def check_op_merge(report, h, hk, d, sizes, device, g, dv=None):
    """A merge of 3 partial states of one (sq x sk) block and the merged-state backward; values ``dv`` wide."""
    (sq, sk), dv = sizes.merge, dv or d
    (q, k, v, dout), ref_in = random_block(h, hk, sq, sk, d, device, g, dv)
    scale = d**-0.5
    want = reference_block(*ref_in, scale, torch.ones(sq, sk, dtype=torch.bool, device=device))
    cols = [slice(c[0].item(), c[-1].item() + 1) for c in torch.tensor_split(torch.arange(sk), 3)]
    out, lse = empty_state(h, sq, dv, q)
    for c in cols:
        merge_into(out, lse, *attention_forward(q, k[:, c], v[:, c], causal=False, scale=scale))
    out = out.to(q.dtype)
    gq, gk, gv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for c in cols:
        bq, bk, bv = attention_backward(dout, q, k[:, c], v[:, c], out, lse, causal=False, scale=scale)
        gq += bq
        gk[:, c] += bk
        gv[:, c] += bv
    errs = dict(zip(("out", "lse", "dq", "dk", "dv"), (rel(a, b) for a, b in zip((out, lse, gq, gk, gv), want))))
    width = f"d{d}" if dv == d else f"dk{d}/dv{dv}"
    report.check(
        max(errs.values()) <= OPS_RTOL,
        f"ops merge of 3 h{h}/kv{hk} {width} {sq}x{sk}",
        fmt(errs) + f" (tol {OPS_RTOL})",
    )


def _kind(sq: int, causal: bool) -> str:
    return "causal" if causal else ("single-query" if sq == 1 else "full")


def check_ops(report, sizes, device):
    g = torch.Generator().manual_seed(0)
    for h, hk in sizes.heads:
        for d in sizes.dims:
            for sq, sk, causal in sizes.blocks:
                name = f"ops h{h}/kv{hk} d{d} {_kind(sq, causal)} {sq}x{sk}"
                check_op_block(report, name, h, hk, sq, sk, d, causal, device, g)
    (h, hk), d, (sq, sk) = sizes.heads[0], max(sizes.dims), sizes.big_block
    check_op_block(report, f"ops h{h}/kv{hk} d{d} full {sq}x{sk}", h, hk, sq, sk, d, False, device, g)
    check_op_merge(report, h, hk, max(sizes.dims), sizes, device, g)
    heads, widths = sizes.mla
    for dk, dv in widths:  # value width apart from the query/key width: the padded kernel calls
        for sq, sk, causal in sizes.blocks:
            name = f"ops value width h{heads} dk{dk}/dv{dv} {_kind(sq, causal)} {sq}x{sk}"
            check_op_block(report, name, heads, heads, sq, sk, dk, causal, device, g, dv)
        check_op_merge(report, heads, heads, dk, sizes, device, g, dv)


# ---- 2. prefix attention --------------------------------------------------------------------------------


def check_prefix_attention(report, sizes, device):
    g = torch.Generator().manual_seed(1)
    (h, hk), d = sizes.heads[0], max(sizes.dims)
    p, lengths = sizes.prefix
    b, rq = len(lengths), max(lengths)
    shapes = dict(q=(b, h, rq, d), k=(b, hk, rq, d), v=(b, hk, rq, d), pk=(1, hk, p, d), pv=(1, hk, p, d))
    low = {n: (torch.randn(*s, generator=g) * 0.5).to(device, torch.bfloat16) for n, s in shapes.items()}
    dout = torch.randn(b, h, rq, d, generator=g).to(device, torch.bfloat16)
    for row, n in enumerate(lengths):
        dout[row, :, n:] = 0  # padded queries carry no gradient
    scale = d**-0.5
    # ours, bf16
    ins = {n: x.clone().requires_grad_() for n, x in low.items()}
    out = prefix_causal_attention(ins["q"], ins["k"], ins["v"], ins["pk"], ins["pv"], scale)
    out.backward(dout)
    # reference: each row's real tokens as one sequence [prompt ; own tokens], float32
    ref = {n: x.float().requires_grad_() for n, x in low.items()}
    ref_out = torch.zeros(b, h, rq, d, device=device)
    total = 0
    for row, n in enumerate(lengths):
        keys = torch.cat([ref["pk"][0], ref["k"][row, :, :n]], 1)
        vals = torch.cat([ref["pv"][0], ref["v"][row, :, :n]], 1)
        visible = torch.ones(n, p + n, dtype=torch.bool, device=device).tril(diagonal=p)
        o, _ = reference_attention(ref["q"][row, :, :n], keys, vals, scale, visible)
        ref_out[row, :, :n] = o
        total = total + (o * dout[row, :, :n].float()).sum()
    total.backward()
    errs = {"out": max(rel(out[r, :, :n], ref_out[r, :, :n]) for r, n in enumerate(lengths))}
    for name in ("q", "k", "v"):
        errs["d" + name] = max(rel(ins[name].grad[r, :, :n], ref[name].grad[r, :, :n]) for r, n in enumerate(lengths))
    errs.update(dpk=rel(ins["pk"].grad, ref["pk"].grad), dpv=rel(ins["pv"].grad, ref["pv"].grad))
    report.check(
        max(errs.values()) <= OPS_RTOL, f"prefix attention P={p} rows {list(lengths)}", fmt(errs) + f" (tol {OPS_RTOL})"
    )


# ---- 3-4. replay vs the float32 flattened baseline -------------------------------------------


def build_model(sizes, device, layers=None):
    config = Qwen2Config(**sizes.model, num_hidden_layers=layers or sizes.layers, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.float().train()


def make_trees(specs, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).to(device)
    return [Tree.of_tokens(ids(p), [ids(r) for r in rs]) for p, rs in specs]


def advantages(trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[float(torch.randn((), generator=g)) for _ in t.responses] for t in trees]


def grouped_replay(model, trees, loss_fn):
    """``replay`` in the flattened baseline's call shape: (model, trees, loss_fn(t, i, logp)) -> log-probs."""
    return replay(model, StepPlan.build(trees), per_response(loss_fn))


def run_step(model, fn, trees, adv):
    """One training step from zero gradients: (log-probs flat float32, gradient flat float32)."""
    model.zero_grad(set_to_none=True)
    logps = fn(model, trees, lambda t, i, logp: -(logp * adv[t][i]).mean())
    flat_logps = torch.cat([x.float().flatten() for row in logps for x in row])
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat_logps, grads


def errors(got, want) -> dict:
    (lp, gr), (lp_ref, gr_ref) = got, want
    return {"logp": (lp - lp_ref).abs().max().item(), "grad": ((gr - gr_ref).norm() / gr_ref.norm()).item()}


def judge(report, name, ours: dict, baseline: dict) -> None:
    ok = all(ours[k] <= max(SLACK * baseline[k], ERR_FLOOR) for k in ours)
    report.check(
        ok,
        name,
        f"logp abs {ours['logp']:.1e} (flattened bf16 {baseline['logp']:.1e}), grad rel "
        f"{ours['grad']:.1e} (flattened bf16 {baseline['grad']:.1e}); slack {SLACK}x",
    )


def check_replay(report, sizes, device):
    model = build_model(sizes, device)
    trees = make_trees(sizes.trees, sizes.model["vocab_size"], device)
    adv = advantages(trees)
    reference = run_step(model, flattened_replay, trees, adv)  # float32
    low = copy.deepcopy(model).to(torch.bfloat16)
    del model
    baseline = errors(run_step(low, flattened_replay, trees, adv), reference)
    judge(
        report,
        f"replay bf16 vs fp32 ({sizes.layers} layers)",
        errors(run_step(low, grouped_replay, trees, adv), reference),
        baseline,
    )
    init_one_rank_group(device)
    try:
        for primitive in ("ring", "tree_move_kv", "move_q"):
            plans = [one_rank_plan(primitive, len(t.responses)) for t in trees]
            planned = lambda m, ts, loss_fn, plans=plans: cp_tree_replay(m, ts, loss_fn, plans)
            judge(
                report,
                f"cp tree run world 1 {primitive} bf16 vs fp32",
                errors(run_step(low, planned, trees, adv), reference),
                baseline,
            )
    finally:
        dist.destroy_process_group()
    return low


def cp_tree_replay(model, trees, loss_fn, plans):
    """Each tree through the CP tree run (``replay.cp_tree``) on the one-rank world: the ring, TreeMoveKV's
    lane ring and MoveQ's query routing with a single member, so their kernels, merges and exchanges run on
    this device (``replay`` itself runs degree-1 plans on the one-device path)."""
    from augtree_verl.cp.schedule import cp_tree_schedule
    from augtree_verl.replay.attention import use_augtree_attention
    from augtree_verl.replay.calls import ModelCalls
    from augtree_verl.replay.cp_tree import CPTreeRun
    from augtree_verl.replay.lockstep import CPTreeSlot

    use_augtree_attention(model)
    calls = ModelCalls(
        model, temperature=1.0, stats=ReplayStats(), entropy_fn=None, micro_batch_loss=per_response(loss_fn)
    )
    run, out = CPTreeRun(calls, dist.group.WORLD), []
    for t, (tree, plan) in enumerate(zip(trees, plans)):
        schedule = cp_tree_schedule(plan, tree.prompt_len, tree.response_lens, 0)
        out.append(run(tree, plan, CPTreeSlot(t, 1, schedule, len(schedule.steps))))
    return out


def one_rank_plan(primitive: str, responses: int) -> Plan:
    if primitive == "ring":
        return Plan(degree=1, primitive="ring")
    return Plan(
        degree=1, primitive=primitive, rounds=responses, lanes=1, placement=tuple((i, 0) for i in range(responses))
    )


def init_one_rank_group(device) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=5),
    )


# ---- 5. prefill memory ----------------------------------------------------------------------------------


def check_prefill_memory(report, sizes, model, device):
    p = sizes.prefill
    h = sizes.model["num_attention_heads"]
    quadratic = h * p * p * 2  # one layer's bf16 score matrix
    if device.type != "cuda":
        report.add("SKIP", f"prefill peak memory {p} tokens", "needs CUDA memory statistics")
        return
    tree = make_trees(((p, (2,)),), sizes.model["vocab_size"], device, seed=2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    replay(model, StepPlan.build(tree))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    report.check(
        extra < quadratic / 4,
        f"prefill peak memory {p} tokens bf16",
        f"{extra / 2**30:.2f} GiB above the weights (one layer's score matrix: {quadratic / 2**30:.1f} GiB;"
        f" limit a quarter of it)",
    )


# ---- 6. host syncs --------------------------------------------------------------------------------------


def count_syncs(fn) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_host_syncs(report, sizes, model, device):
    if device.type != "cuda":
        report.add("SKIP", "host syncs", "torch.cuda.set_sync_debug_mode needs CUDA")
        return
    trees = make_trees(sizes.trees, sizes.model["vocab_size"], device, seed=3)
    adv = advantages(trees)
    loss = lambda t, i, logp: -(logp * adv[t][i]).mean()
    run_step(model, grouped_replay, trees, adv)  # warm-up: first-call allocations, cuBLAS handles
    forward = count_syncs(lambda: replay(model, StepPlan.build(trees)))
    train = count_syncs(lambda: replay(model, StepPlan.build(trees), per_response(loss)))
    flattened = count_syncs(lambda: flattened_replay(model, trees, loss))
    model.zero_grad(set_to_none=True)
    n = len(trees)
    report.check(
        forward <= n and train <= flattened + n,
        "host syncs",
        f"replay forward {forward} (expected <= {n}, one id check per tree), replay train {train}, "
        f"flattened train {flattened} (replay train must be <= flattened + {n})",
    )


# ---- 7. speed -------------------------------------------------------------------------------------------


def check_speed(report, sizes, model, device):
    vocab = sizes.model["vocab_size"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, trees, adv):
        """Seconds of one training step (forward, loss, backward), from zero gradients."""
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        fn(model, trees, lambda t, i, logp: -(logp * adv[t][i]).mean())
        sync()
        return time.perf_counter() - start

    for name, (p, r, g) in sizes.speed.items():
        trees = make_trees(((p, (r,) * g),), vocab, device, seed=4)
        adv = advantages(trees)
        timed(flattened_replay, trees, adv), timed(grouped_replay, trees, adv)  # warm-up
        pairs = [(timed(flattened_replay, trees, adv), timed(grouped_replay, trees, adv)) for _ in range(sizes.repeats)]
        ratio = statistics.median(f / o for f, o in pairs)
        flat, ours = (statistics.median(x) for x in zip(*pairs))
        model.zero_grad(set_to_none=True)
        report.add(
            "INFO",
            f"speed {name} P={p} R={r} G={g}",
            f"flattened {flat:.3f} s, replay {ours:.3f} s: {ratio:.2f}x (median of {len(pairs)} paired ratios)",
        )


# ---- 8. prompt-activation offload ----------------------------------------------------------------------


def check_offload(report, sizes, model, device):
    cuda = device.type == "cuda"
    p, r, g = (16384, 128, 4) if cuda else (192, 6, 2)
    trees = make_trees(((p, (r,) * g),), sizes.model["vocab_size"], device, seed=5)
    adv = advantages(trees)
    loss = lambda t, i, logp: -(logp * adv[t][i]).mean()

    def step(offload):
        """(log-probs, gradient, peak bytes above the start (CUDA), seconds) of one training step."""
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        logps = replay(model, StepPlan.build(trees), per_response(loss), ReplayOptions(offload=offload))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - before if cuda else 0
        flat = torch.cat([x.float().flatten() for row in logps for x in row])
        grad = torch.cat([q.grad.float().flatten() for q in model.parameters() if q.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat, grad, peak, seconds

    new = lambda: Offload(min_bytes=None if cuda else 0)  # the smoke model's activations are all small
    step(None), step(new())  # warm-up: allocator, pinned host pool
    runs = []
    for _ in range(sizes.repeats):
        offload = new()
        runs.append((step(None), step(offload), offload.stats))
    (lp_off, gr_off, peak_off, _), (lp_on, gr_on, peak_on, _), stats = runs[-1]
    errs = {"logp": rel(lp_on, lp_off), "grad": rel(gr_on, gr_off)}
    cost = statistics.median(on[3] / off[3] for off, on, _ in runs)
    moved = stats.offloaded_bytes
    ok = max(errs.values()) <= OPS_RTOL and moved > 0
    if cuda:  # the copies add no host sync: a training step syncs as often with offload as without
        syncs = [count_syncs(lambda o=o: step(o)) for o in (None, new())]
        ok = ok and peak_on < peak_off and syncs[1] <= syncs[0]
    peaks = (
        f"peak above the weights {peak_off / 2**30:.2f} -> {peak_on / 2**30:.2f} GiB "
        f"({1 - peak_on / peak_off:.0%} lower), host syncs {syncs[0]} -> {syncs[1]}"
        if cuda
        else "peak and syncs: CUDA only"
    )
    report.check(
        ok,
        f"offload long prompt P={p} G={g}",
        f"{peaks}, step time {cost:.2f}x, {moved / 2**20:.1f} MiB offloaded, "
        f"{stats.prefetched_bytes / max(moved, 1):.0%} prefetched; {fmt(errs)} vs no offload "
        f"(tol {OPS_RTOL})",
    )


# ---- 9. hybrid Gated DeltaNet -------------------------------------------------------------------------------


def check_hybrid(report, sizes, device):
    config = Qwen3_5TextConfig(
        **sizes.hybrid,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).float().train()
    linear = model.model.layers[0].linear_attn
    with torch.no_grad():  # a decay that keeps ~90% of the state per token (the prompt's state reaches the responses)
        linear.A_log.copy_(torch.empty_like(linear.A_log).uniform_(0.02, 0.2).log())
    trees = make_trees(sizes.trees, config.vocab_size, device)
    adv = advantages(trees)
    kernel = linear.chunk_gated_delta_rule  # the module's pick: fla's on CUDA when installed
    linear.chunk_gated_delta_rule = torch_chunk_gated_delta_rule  # the float32 reference on the torch kernel
    reference = run_step(model, flattened_replay, trees, adv)
    linear.chunk_gated_delta_rule = kernel
    low = model.to(torch.bfloat16)
    baseline = errors(run_step(low, flattened_replay, trees, adv), reference)
    judge(
        report,
        f"hybrid replay bf16 vs fp32 ({kernel.__module__.split('.')[0]} delta rule)",
        errors(run_step(low, grouped_replay, trees, adv), reference),
        baseline,
    )
    init_one_rank_group(device)
    try:
        worst = {"logp": 0.0, "grad": 0.0}
        for primitive in ("ring", "tree_move_kv", "move_q"):
            plans = [one_rank_plan(primitive, len(t.responses)) for t in trees]
            planned = lambda m, ts, loss_fn, plans=plans: cp_tree_replay(m, ts, loss_fn, plans)
            got = errors(run_step(low, planned, trees, adv), reference)
            worst = {k: max(worst[k], got[k]) for k in worst}
        judge(report, "hybrid cp tree run world 1 (state scan) bf16 vs fp32, worst of 3 primitives", worst, baseline)
    finally:
        dist.destroy_process_group()


# ---- 11. vision-language ------------------------------------------------------------------------------------


def vision_trees(model, specs, device, seed=0) -> list[Tree]:
    """``specs`` (``Sizes.images``) as trees: text drawn below the special tokens (the vocabulary's last four), an
    image's tokens and bf16-rounded patches, its prompt's M-RoPE positions from the model's ``get_rope_index``."""
    config, g = model.config, torch.Generator().manual_seed(seed)
    vision = config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    text = lambda n: torch.randint(0, config.image_token_id, (n,), generator=g)
    trees = []
    for before, grid, after, responses in specs:
        image = [] if grid is None else [config.image_token_id] * (math.prod(grid) // vision.spatial_merge_size**2)
        prompt = torch.cat([text(before), torch.tensor(image, dtype=torch.long), text(after)])
        seen = None
        if grid is not None:
            pixels = torch.randn(math.prod(grid), patch_dim, generator=g).to(torch.bfloat16).float().to(device)
            ids, grid_thw = prompt.to(device), torch.tensor([grid], device=device)
            mrope, _ = model.model.get_rope_index(
                ids[None], mm_token_type_ids=(ids == config.image_token_id).int()[None], image_grid_thw=grid_thw
            )
            positions = torch.cat([torch.arange(len(ids), device=device)[None], mrope[:, 0].to(device)])
            seen = Vision(pixels, grid_thw, positions)
        trees.append(Tree.of_tokens(prompt.to(device), [text(r).to(device) for r in responses], vision=seen))
    return trees


def check_vision(report, sizes, device):
    text = {k: v for k, v in sizes.model.items() if k != "rope_theta"}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    rope = dict(rope_type="default", rope_theta=sizes.model.get("rope_theta", 10000.0))
    vocab = text["vocab_size"]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            text,
            num_hidden_layers=sizes.layers,
            head_dim=head_dim,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters=dict(rope, mrope_section=sizes.vision["mrope_section"]),
        ),
        vision_config=dict(sizes.vision["tower"], out_hidden_size=text["hidden_size"]),
        image_token_id=vocab - 4,
        video_token_id=vocab - 3,
        vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).float().train()
    trees = vision_trees(model, sizes.images, device)
    adv = advantages(trees)
    rope_regimes = RopeRegimes.of(model.config)
    grouped = lambda m, ts, loss_fn: replay(m, StepPlan.build(ts, rope=rope_regimes), per_response(loss_fn))
    flattened = lambda m, ts, loss_fn: flattened_replay(m, ts, loss_fn, mrope=True)
    reference = run_step(model, flattened, trees, adv)  # float32
    low = model.to(torch.bfloat16)
    baseline = errors(run_step(low, flattened, trees, adv), reference)
    calls = []
    hook = low.model.visual.register_forward_hook(lambda *_: calls.append(1))
    ours = errors(run_step(low, grouped, trees, adv), reference)
    hook.remove()
    judge(
        report,
        f"vision-language replay bf16 vs fp32 ({sizes.layers} layers, tower of {config.vision_config.depth})",
        ours,
        baseline,
    )
    images = sum(t.vision is not None for t in trees)
    report.check(len(calls) == images, "vision tower once per tree", f"{len(calls)} calls for {images} image trees")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same checks on CPU, small shapes")
    parser.add_argument("--json", help="write the report lines here")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), SMOKE
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device here; run it on a GPU machine, or pass --cpu-smoke")
        device, sizes = torch.device("cuda", 0), GPU
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
        torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    backend = "cpu" if device.type == "cpu" else cuda_backend_name()
    print(
        f"gpu_check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch "
        f"{torch.__version__}, attention backend {backend}",
        flush=True,
    )
    report = Report()
    check_ops(report, sizes, device)
    check_prefix_attention(report, sizes, device)
    model = check_replay(report, sizes, device)
    check_prefill_memory(report, sizes, model, device)
    check_host_syncs(report, sizes, model, device)
    check_speed(report, sizes, model, device)
    check_offload(report, sizes, model, device)
    del model
    check_hybrid(report, sizes, device)
    check_vision(report, sizes, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), backend=backend, rows=report.rows), f, indent=1)
    failed = report.failed
    print(
        f"gpu_check: {'FAIL' if failed else 'PASS'} ({len(report.rows)} checks, {len(failed)} failed"
        f"{': ' + ', '.join(failed) if failed else ''}; {time.perf_counter() - started:.0f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
