"""``AugTreeEngine``: verl's FSDP engine with the update stage run as grouped replay (prompt once per tree).

Everything but ``forward_backward_batch`` is verl's ``FSDPEngineWithLMHead`` (FSDP2 sharding, optimizer,
checkpoints, offload). ``forward_backward_batch`` keeps verl's contract:

- verl's micro-batches are built exactly as verl builds them, and verl's ``loss_function`` is called once
  per micro-batch on them, unchanged, so every loss mode and every metric comes out as with the stock engine;
- ``model_output["log_probs"]`` (and ``["entropy"]`` when asked) are nested over each full sequence, position
  k scoring token k + 1. Only the response part (positions P-1 .. P+R-2) is computed; other positions are 0.

Training is one pass. The micro-batches are grouped into replay units (``replay_units``: micro-batches that
share trees, within the stock engine's memory bound); per unit, one ``replay(keep_graph=True)`` of the unit's
trees gives log-probs (and entropies) attached to one graph in which each prompt appears once, verl's loss
runs on each of the unit's micro-batches, and one backward of their sum puts exactly verl's gradient into
the parameters. Forward-only replays every tree of the step at once, without a graph.
Parameters stay gathered over the step and gradient sync is held back until one reduction after the last
backward (``gathered_for_replay``): ranks hold different trees, so per-call FSDP collectives could not line up.

Context parallelism (``cp_degrees`` above 1): ranks form CP groups of C = max(cp_degrees) (``cp_mesh``);
the engine reports data-parallel rank and size = world / C to verl, so every rank of a CP group gets the
same samples, and the group replays each tree once: plans of degree d > 1 context-parallel on d of its
ranks, the other trees spread over its ranks (``group_replay``). Every rank of the group computes verl's
loss on the whole micro-batch; its gradients add up over the group.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from augtree_verl.integration import verl_compat
from augtree_verl.integration.batch_trees import build_trees, sequence_lengths
from augtree_verl.integration.config import FSDP_STRATEGY, AugTreeEngineConfig
from augtree_verl.integration.cp_mesh import CPMesh, schedule_trees
from augtree_verl.integration.fsdp_model import FSDPReplayModel, gathered_for_replay
from augtree_verl.integration.group_replay import replay_in_group
from augtree_verl.integration.metrics import group_totals, step_metrics
from augtree_verl.integration.plans import plans_for_trees
from augtree_verl.integration.replay_units import replay_units
from augtree_verl.plan import Plan
from augtree_verl.replay import ReplayStats

UNSUPPORTED_FLAGS = ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")


class AugTreeEngine(FSDPEngineWithLMHead):
    """verl engine backend "augtree" (see the module docstring). Config: ``AugTreeEngineConfig``."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if not isinstance(engine_config, AugTreeEngineConfig):
            raise ValueError(
                f"the augtree engine needs an AugTreeEngineConfig, got {type(engine_config).__name__}; set "
                "actor_rollout_ref.actor.fsdp_config._target_=augtree_verl.integration.config.AugTreeEngineConfig")
        if engine_config.ulysses_sequence_parallel_size != 1:
            raise ValueError(f"the augtree engine does not combine with Ulysses sequence parallelism "
                             f"(ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size})")
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_fsdp_module(self, module):
        # verl's builder branches on the strategy string and knows only fsdp/fsdp2: build as fsdp2.
        requested = self.engine_config.strategy
        verl_compat.set_frozen_field(self.engine_config, "strategy", FSDP_STRATEGY)
        try:
            return super()._build_fsdp_module(module)
        finally:
            verl_compat.set_frozen_field(self.engine_config, "strategy", requested)

    def _init_device_mesh(self):
        super()._init_device_mesh()
        self.cp_mesh = CPMesh(self.engine_config.cp_degrees)

    # verl dispatches data by these: every rank of a CP group is the same data-parallel rank.
    def get_data_parallel_rank(self):
        return self.cp_mesh.dp_rank

    def get_data_parallel_size(self):
        return torch.distributed.get_world_size() // max(self.engine_config.cp_degrees)

    def get_data_parallel_group(self):
        return self.cp_mesh.dp_group

    def get_context_parallel_group(self):
        return self.cp_mesh.cp_group

    def is_mp_src_rank_with_outputs(self):
        return self.cp_mesh.cp_rank == 0

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        if loss_function is None and not forward_only:
            raise ValueError("training (forward_only=False) needs a loss_function")
        _check_supported(data)
        # As verl does for Ulysses: a CP group's micro-batch may hold C ranks' tokens (it is spread over them).
        tu.assign_non_tensor(data, sp_size=self.cp_mesh.cp_size)
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        dp_group = self.get_data_parallel_group()
        # Global token count for loss normalisation, as verl's engine computes it.
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=True)
        micro_batches = [mb.to(get_device_id()) for mb in micro_batches]

        train = not forward_only
        units = (replay_units(build_trees(micro_batches), len(micro_batches)) if train
                 else [list(range(len(micro_batches)))])
        want_entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
        step = _Step(temperature=_temperature(data), want_entropy=want_entropy)
        output_lst: list[dict | None] = [None] * len(micro_batches)
        with gathered_for_replay(self.module, reshard_after_forward=self.engine_config.reshard_after_forward,
                                 hold_gradient_sync=train):
            for unit in units:
                model_outputs, finish = self._replay(step, [micro_batches[m] for m in unit], keep_graph=train)
                unit_loss = None
                for m, model_output in zip(unit, model_outputs):
                    if loss_function is None:
                        loss, metrics = torch.tensor(1.0), {}
                    else:
                        loss, metrics = loss_function(model_output=model_output, data=micro_batches[m],
                                                      dp_group=dp_group)
                        unit_loss = loss if unit_loss is None else unit_loss + loss
                    output_lst[m] = {"loss": loss.detach().item(), "metrics": metrics}
                    if forward_only or return_model_output:
                        output_lst[m]["model_output"] = {k: v.detach() for k, v in model_output.items()}
                if train:
                    # The micro-batch losses' gradients add up: one backward of their sum runs each prompt once.
                    # Times C: a CP group's C ranks share one data-parallel rank's gradient (group_replay).
                    start = time.perf_counter()
                    unit_loss = unit_loss * self.cp_mesh.cp_size
                    if unit_loss.requires_grad:  # False on a CP rank that replayed none of the unit's trees
                        (self.scaler.scale(unit_loss) if self.scaler is not None else unit_loss).backward()
                    finish()
                    step.backward_s += time.perf_counter() - start
        stats, backward_s = step.stats, step.backward_s
        if self.cp_mesh.cp_size > 1:
            stats, backward_s = group_totals(stats, backward_s, self.cp_mesh.cp_group, batch_num_tokens.device)
        output_lst[0]["metrics"] = {**output_lst[0]["metrics"],
                                    **step_metrics(stats, step.plans, backward_s=backward_s,
                                                   plan_fallbacks=step.plan_fallbacks)}
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _replay(self, step: "_Step", micro_batches: list[TensorDict], *, keep_graph: bool):
        """(verl's model outputs for ``micro_batches``, whose rows are replayed together as one set of trees,
        and the ``finish`` to call after the backward; see ``group_replay``).

        With ``keep_graph`` the outputs are attached to one graph (each prompt once) for the caller's backward.
        """
        grouped = build_trees(micro_batches)
        plans, fallbacks = (plans_for_trees(micro_batches, grouped, self.cp_mesh.degrees,
                                            min_cp_tokens=self.engine_config.fallback_threshold_tokens)
                            if self.engine_config.use_planner else ([None] * len(grouped.trees), 0))
        degrees, placement = schedule_trees(grouped.trees, plans, self.cp_mesh.cp_size)
        # A tree the schedule moved to one rank runs there with the one-device plan.
        plans = [plan if plan is None or plan.degree == d else Plan(est_time_s=plan.est_single_s)
                 for plan, d in zip(plans, degrees)]
        step.plans += plans
        step.plan_fallbacks += fallbacks
        scores, finish = replay_in_group(
            FSDPReplayModel(self.module), self.cp_mesh, grouped.trees, plans, placement, temperature=step.temperature,
            micro_batch_tokens=self.engine_config.micro_batch_tokens, stats=step.stats, train=keep_graph,
            entropy_fn=self._entropy if step.want_entropy else None)
        outputs = []
        for m, mb in enumerate(micro_batches):
            row_scores = [scores[grouped.slot[(m, k)]] for k in range(len(mb))]
            prompt_lens, _ = sequence_lengths(mb)
            offsets = mb["input_ids"].offsets()
            output = {"log_probs": _full_sequence([logp for logp, _ in row_scores], prompt_lens, offsets)}
            if step.want_entropy:
                output["entropy"] = _full_sequence([entropy for _, entropy in row_scores], prompt_lens, offsets)
            outputs.append(output)
        return outputs, finish

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy [N] of tempered logits [N, V], computed as verl's stock engine computes it (same knobs)."""
        compute = self.compute_entropy_from_logits
        if self.engine_config.entropy_from_logits_with_chunking:
            compute = functools.partial(compute, chunk_size=self.engine_config.entropy_from_logits_chunk_size)
        if self.engine_config.entropy_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(compute, logits, use_reentrant=False)
        return compute(logits)


class _Step:
    """What one ``forward_backward_batch`` accumulates over its replay units (for the step's metrics)."""

    def __init__(self, *, temperature: float, want_entropy: bool):
        self.temperature, self.want_entropy = temperature, want_entropy
        self.stats = ReplayStats()
        self.plans: list[Plan | None] = []
        self.plan_fallbacks = 0
        self.backward_s = 0.0


def _check_supported(data: TensorDict) -> None:
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"the augtree engine takes verl's no-padding batches, got pad_mode={pad_mode}")
    for flag in UNSUPPORTED_FLAGS:
        if tu.get_non_tensor_data(data=data, key=flag, default=False):
            raise ValueError(f"the augtree engine does not support {flag}=True")
    # verl's agent loop writes multi_modal_inputs for every sample, an empty dict for text: only a non-empty
    # one means multimodal input.
    for row, inputs in enumerate(tu.get(data, "multi_modal_inputs", default=None) or []):
        if inputs:
            uid = tu.get(data, "uid", default=None)
            raise ValueError(f"the augtree engine replays text-only batches; row {row} (uid "
                             f"{uid[row] if uid is not None else '?'!r}) has multi_modal_inputs {sorted(inputs)}")


def _temperature(data: TensorDict) -> float:
    temperature = data["temperature"]
    if isinstance(temperature, torch.Tensor):
        values = temperature.flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"the augtree engine needs one temperature per batch, got {values.tolist()}")
        return float(values[0])
    return float(temperature)


def _full_sequence(responses: list[torch.Tensor], prompt_lens: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """Per-row response values [R_k] -> verl's nested tensor over each full sequence (offsets [rows + 1]).

    Row k's values sit at positions P_k - 1 .. P_k + R_k - 2 (position j scores token j + 1); the other
    positions are 0. Built with ``torch.cat``, so a graph the values carry reaches the loss.
    """
    pieces = []
    for values, prompt_len in zip(responses, prompt_lens):
        pieces += [values.new_zeros(prompt_len - 1), values, values.new_zeros(1)]
    return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets)
