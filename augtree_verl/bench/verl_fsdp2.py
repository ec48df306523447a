"""The ``verl-fsdp2`` method: verl 0.9.1's stock FSDP2 actor engine, as users configure it, on the bench's steps.

verl is imported only when this method runs (``VerlFsdp2.build``), so ``augtree bench`` still starts fast.

What runs: verl's real engine (``augtree_verl.testing.harness.build_engine("fsdp2")``: our CPU platform, gloo,
fp32, remove-padding) loaded with the bench model's weights. Its fairest CPU setting: one sequence per verl
micro-batch (``micro_batch_size_per_gpu=1``, no dynamic batch size), so SDPA, which has no varlen kernel on CPU,
never attends across the sequences of a packed micro-batch. At d ranks it runs as stock verl does: data
parallel (FSDP2, ZeRO-3) over the step's responses, dealt round-robin over the ranks, each [prompt ‖ response]
its own sequence; a rank with fewer responses gets a fully masked copy of one of its rows (zero loss and
gradient, as verl pads a batch to the data-parallel size), because FSDP2 ranks run their micro-batches in
lock-step. The timed step is verl's ``forward_backward_batch`` (what ``train_batch`` runs between zeroing the
gradients and the optimizer step), the same work the other methods' steps do.

What is checked: verl's loss is its ``ppo_loss``, not the bench's ``grpo_loss``. With old log-probs equal to
the current ones (taken from this engine's own ``infer_batch``), the bench's GRPO advantages per response and
token-mean aggregation over the whole step, ``ppo_loss`` is the same objective, -Σ A·ratio / N with ratio 1;
so its gradients are compared with the flattened baseline's like every other method's, and its log-probs with
the flattened baseline's log-probs (``max_logp_rel_err``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from augtree_verl.bench.loss import group_advantages
from augtree_verl.groups import Tree
from augtree_verl.replay.baseline import flattened_replay

# verl's micro-batch knobs for this method (see the module docstring).
VERL_SETTINGS: dict[str, Any] = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=1)


def rank_rows(trees: Sequence[Tree], seed: int, rank: int, world: int) -> tuple[list[dict], int]:
    """This rank's share of the step's responses as verl rows, and how many of them are real (the rest: padding).

    Responses are dealt round-robin over the ranks in (tree, response) order; every rank gets
    ceil(total / world) rows, a short rank's last row a copy of its first with advantage 0 (and its masks zeroed
    by ``prepare``): no loss, no gradient, no tokens in verl's token count.
    """
    advantages = group_advantages(trees, seed)
    flat = [(t, i) for t, tree in enumerate(trees) for i in range(len(tree.responses))]
    per_rank = -(-len(flat) // world)
    rows = [
        dict(
            uid=f"tree-{t}",
            prompt=trees[t].prompt.cpu(),
            response=trees[t].responses[i].cpu(),
            advantage=float(advantages[t][i]),
            masked=False,
        )
        for t, i in flat[rank::world]
    ]
    real = len(rows)
    rows += [
        {**(rows[0] if rows else _first_row(trees)), "advantage": 0.0, "masked": True} for _ in range(per_rank - real)
    ]
    return rows, real


def _first_row(trees: Sequence[Tree]) -> dict:
    return dict(uid="tree-0", prompt=trees[0].prompt.cpu(), response=trees[0].responses[0].cpu(), advantage=0.0)


@dataclass
class VerlStep:
    """One workload's verl batch on this rank, ready to time; the other fields are over all ranks."""

    batch: Any
    max_logp_rel_err: float
    executed_tokens: int  # [prompt ‖ response] tokens run, padding rows included


class VerlFsdp2:
    """verl's fsdp2 engine, built once per bench run on every rank (inside the bench's process group)."""

    def __init__(self, engine, loss_fn, owns_group: bool):
        self.engine, self.loss_fn, self.owns_group = engine, loss_fn, owns_group

    @classmethod
    def build(cls, model) -> VerlFsdp2:
        """verl's engine with ``model``'s weights (saved to a private folder and loaded the way verl loads them).

        ``model``: the bench's model, on CPU. Call on every rank after the process group is up (or with none:
        a world-size-1 group is made here)."""
        from augtree_verl.testing import harness

        harness.use_cpu_platform()
        owns_group = not dist.is_initialized()
        harness.init_process_group()
        with tempfile.TemporaryDirectory(prefix="augtree-bench-verl-") as path:
            model.save_pretrained(path)
            engine, loss_fn = harness.build_engine("fsdp2", path)
        return cls(engine, loss_fn, owns_group)

    def close(self) -> None:
        """Destroy the world-size-1 process group ``build`` made, if it made one."""
        if self.owns_group:
            dist.destroy_process_group()

    def prepare(self, model, trees: Sequence[Tree], seed: int, rank: int, world: int) -> VerlStep:
        """This rank's batch with old log-probs from verl's own forward, checked against the flattened baseline."""
        from verl.utils import tensordict_utils as tu

        from augtree_verl.testing import verl_batch

        rows, real = rank_rows(trees, seed, rank, world)
        batch = verl_batch.rows_to_batch(rows, **VERL_SETTINGS)
        for key in ("loss_mask", "response_mask"):  # verl counts tokens by the first, aggregates by the second
            batch[key] = torch.nested.as_nested_tensor(
                [torch.full((len(r["response"]),), 0 if r["masked"] else 1, dtype=torch.int64) for r in rows],
                layout=torch.jagged,
            )
        probe = batch.clone()
        tu.assign_non_tensor(probe, calculate_entropy=False)
        with self.engine.eval_mode():
            out = self.engine.infer_batch(probe, loss_function=None)
        logps = verl_batch.response_values(out, batch)
        batch["old_log_probs"] = torch.nested.as_nested_tensor([x.detach() for x in logps], layout=torch.jagged)
        ours = [Tree.of_tokens(r["prompt"], [r["response"]]) for r in rows[:real]]
        want = [row[0] for row in flattened_replay(model, ours)] if ours else []
        executed = torch.tensor(sum(len(r["prompt"]) + len(r["response"]) for r in rows))
        if world > 1:
            dist.all_reduce(executed)
        return VerlStep(batch, _max_rel_err(logps[:real], want, world), int(executed))

    def step(self, prepared: VerlStep) -> None:
        """One update step without the optimizer: zero the gradients, ``forward_backward_batch`` (the gradients
        stay for ``full_grads``: verl's train mode zeroes them on exit unless told not to)."""
        with self.engine.train_mode(zero_grad_on_exit=False):
            self.engine.optimizer_zero_grad()
            self.engine.forward_backward_batch(prepared.batch.clone(), loss_function=self.loss_fn)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's full gradient (FSDP2 already reduced it over the ranks), in float32, by name.

        Collective: every rank calls it."""
        out = {}
        for name, p in self.engine.module.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float()
        return out


def _max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor], world: int) -> float:
    """max|got - want| / max|want| over all rows of all ranks (each [R] per row); NaN wins."""
    diff = torch.stack([(g - w.to(g)).abs().max() for g, w in zip(got, want)] or [torch.tensor(0.0)]).max()
    scale = torch.stack([w.abs().max() for w in want] or [torch.tensor(0.0)]).max()
    both = torch.stack([diff, scale]).double()
    if world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
    diff, scale = both.tolist()
    return diff / scale if scale > 0 else diff
