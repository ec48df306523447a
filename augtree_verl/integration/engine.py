"""``AugTreeEngine``: verl's FSDP engine with the update stage run as grouped replay (prompt once per tree).

Everything but ``forward_backward_batch`` is verl's ``FSDPEngineWithLMHead`` (FSDP2 sharding, optimizer,
checkpoints, offload). ``forward_backward_batch`` keeps verl's contract:

- verl's micro-batches are built exactly as verl builds them; verl's ``loss_function``, unchanged, reports
  the loss and metrics of each of them, so every metric comes out as with the stock engine, and gives the
  gradient: on the replay's own micro-batches where the loss is a sum of per-row terms, else on verl's
  micro-batches at the scores of a forward-only pass first (``integration.loss_calls``);
- ``model_output["log_probs"]`` (and ``["entropy"]`` when asked) are nested over each full sequence, position
  k scoring token k + 1. Only the response part (positions P-1 .. P+R-2) is computed; other positions are 0.

Each step is one ``StepPlan`` (``replay.step_plan``: the trees, the trainer's plans decoded from the batch,
each tree's CP subgroup, the lock-step slots), built once and run by ``replay`` (one path with and without CP):
per tree the prompt runs
once (its K/V kept as float32 leaves, ``replay.prompt_kv``), the tree's responses run as the engine's own
micro-batches (one device: under the largest verl micro-batch's tokens; context-parallel: one CP step of
the plan each), each with verl's ``loss_function`` on its rows (verl's batch-level normalisers make these
losses add up to verl's) and its backward, then one delayed prompt backward. So each prompt runs once per
step and rank whatever verl's micro-batch size. Every rank of the world makes the same sequence of model
calls (``replay.lockstep``: phases by CP degree, padding with dummy calls), so FSDP2 gathers parameters per
layer and reduce-scatters gradients per backward, as the stock engine does (ZeRO-3). Reported losses and
metrics are verl's, per verl micro-batch, evaluated on the detached outputs. A vision-language checkpoint's
text-only rows run on its text decoder and LM head, with verl's zero-weighted dummy vision forward once per
training step (``integration.vlm``); a prompt with images runs its vision tower once per tree, inside its prefill
(``replay.vlm``); video rows are refused at the first batch, naming them.

Context parallelism (``cp_degrees`` above 1): ranks form CP groups of C = max(cp_degrees) (``cp.mesh``);
the engine reports data-parallel rank and size = world / C to verl, so every rank of a CP group gets the
same samples, and the group replays each tree once: plans of degree d > 1 context-parallel on d of its
ranks (after ``step_plan.assign_subgroups``' demotions), the other trees spread over its ranks. ``replay`` returns
every response's scores on every rank of the group; gradients add up over the group, and every loss is
scaled by C (FSDP averages over the world, and a CP group is one data-parallel rank).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from augtree_verl.cp.mesh import CPMesh
from augtree_verl.integration import verl_compat
from augtree_verl.integration.batch_trees import build_trees, sequence_lengths, vision_splits
from augtree_verl.integration.config import FSDP_STRATEGY, AugTreeEngineConfig
from augtree_verl.integration.fsdp_model import FSDPReplayModel
from augtree_verl.integration.loss_calls import adjoint_loss, coupling, micro_batch_adjoints
from augtree_verl.integration.metrics import group_totals, step_metrics
from augtree_verl.integration.run_profile import make_run_profile
from augtree_verl.integration.vlm import prepare_for_replay
from augtree_verl.model_shape import text_config
from augtree_verl.plan import Plan
from augtree_verl.plan_field import PLAN_FIELD
from augtree_verl.planner.cost import cost_model
from augtree_verl.replay import Offload, ReplayOptions, ReplayStats, StepPlan, replay
from augtree_verl.replay.adapters import causal_lm
from augtree_verl.replay.memory import STOCK_ENGINE, ReplayMemory, device_budget_bytes
from augtree_verl.replay.model_check import check_model, probe_exactness, refusal
from augtree_verl.replay.rope import RopeRegimes

logger = logging.getLogger(__name__)
UNSUPPORTED_FLAGS = ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only", "use_fused_kernels")


class AugTreeEngine(FSDPEngineWithLMHead):
    """verl engine backend "augtree" (see the module docstring). Config: ``AugTreeEngineConfig``."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if not isinstance(engine_config, AugTreeEngineConfig):
            raise ValueError(
                f"the augtree engine needs an AugTreeEngineConfig, got {type(engine_config).__name__}; set "
                "actor_rollout_ref.actor.fsdp_config._target_=augtree_verl.integration.config.AugTreeEngineConfig"
            )
        if engine_config.ulysses_sequence_parallel_size != 1:
            raise ValueError(
                f"the augtree engine does not combine with Ulysses sequence parallelism "
                f"(ulysses_sequence_parallel_size={engine_config.ulysses_sequence_parallel_size})"
            )
        if getattr(model_config, "use_fused_kernels", False):
            raise ValueError(
                "the augtree engine does not run verl's fused kernels (actor_rollout_ref.model.use_fused_kernels="
                "True): it scores the response tokens through the model's own LM head and logit transforms, one "
                "call per replay micro-batch. Set actor_rollout_ref.model.use_fused_kernels=False, or train on "
                f"verl's stock engine: {STOCK_ENGINE}"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def initialize(self):
        super().initialize()
        self._probe_exactness()
        if not self.engine_config.forward_only:  # the planner's profile of this run (integration.run_profile)
            self.run_profile = make_run_profile(self)

    def _probe_exactness(self) -> None:
        """The start-up exactness probe on the user's model (``replay.model_check.probe_exactness``): prompt
        reuse against the model's ordinary forward, in the mode the engine trains (or, forward only, infers) in,
        on a short tree, across every length threshold of the model and on a row of the run's lengths
        (``probe_prompt_tokens``, ``probe_response_tokens``), rows capped to what ``replay_memory_budget_gib``
        (or, on CUDA, the free memory) holds; refuses the model beyond the dtype's tolerance. Every rank runs it.
        Its cost: each probe tree forward and backward twice (prompt reuse, flattened rows); at the run's lengths
        about two training rows of the longest length and one of the prompt."""
        config = self.engine_config
        train = not config.forward_only
        world = torch.distributed.get_world_size()
        with self.train_mode() if train else self.eval_mode():
            self.exactness_probe = probe_exactness(
                FSDPReplayModel(self.module),
                self.module,
                train=train,
                lockstep_group=torch.distributed.group.WORLD if world > 1 else None,
                prompt_tokens=config.probe_prompt_tokens,
                response_tokens=config.probe_response_tokens,
                budget_bytes=device_budget_bytes(
                    config.replay_memory_budget_gib, self.module.get_input_embeddings().weight.device
                ),
                checkpointing=bool(self.model_config.enable_gradient_checkpointing),
            )
        probe = self.exactness_probe
        logger.info(
            "augtree exactness probe (%s): log-prob error %.2e, gradient error %.2e; trees (prompt, responses) %s, "
            "rows capped at %s tokens; %d tokens, %.3f s",
            probe.dtype,
            probe.logp_err,
            probe.grad_err,
            list(probe.trees),
            probe.row_cap if probe.row_cap is not None else "no",
            probe.tokens,
            probe.seconds,
        )

    def _build_fsdp_module(self, module):
        # transformers' forwards for the modules verl's monkey patches replaced process-wide (``integration.vlm``)
        prepare_for_replay(causal_lm(module))
        # Refuse, by name, what the replay does not implement, before any work.
        check_model(module, training=not self.engine_config.forward_only)
        if self.engine_config.pad_to_length and RopeRegimes.of(text_config(module.config)) is not None:
            # the stock engine's padded segment would then choose the rope (its positions restart at 0 up to the
            # bucket's pad), which the rows' call lengths (``Tree.call_lens``) do not say
            raise ValueError(
                refusal(
                    getattr(module.config, "model_type", None) or type(module).__name__,
                    {
                        "a length-dependent rope with verl's bucket padding": (
                            [],
                            f"pad_to_length=True, pad_to_length_bucket={self.engine_config.pad_to_length_bucket}",
                        )
                    },
                )
            )
        # verl's builder branches on the strategy string and knows only fsdp/fsdp2: build as fsdp2.
        requested = self.engine_config.strategy
        verl_compat.set_frozen_field(self.engine_config, "strategy", FSDP_STRATEGY)
        try:
            return super()._build_fsdp_module(module)
        finally:
            verl_compat.set_frozen_field(self.engine_config, "strategy", requested)

    def _init_device_mesh(self):
        super()._init_device_mesh()
        self.cp_mesh = CPMesh.build(self.engine_config.cp_degrees)

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
        want_entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
        step = _Step(temperature=_temperature(data), want_entropy=want_entropy)
        output_lst = self._stream(step, micro_batches, loss_function, forward_only, return_model_output)
        stats = step.stats
        if self.cp_mesh.cp_size > 1:
            stats = group_totals(stats, self.cp_mesh.cp_group, batch_num_tokens.device)
        output_lst[0]["metrics"] = {
            **output_lst[0]["metrics"],
            **step_metrics(stats, step.plans, plan_fallbacks=step.plan_fallbacks, cp_demoted=step.cp_demoted),
        }
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _stream(
        self, step: _Step, micro_batches: list[TensorDict], loss_function, forward_only: bool, return_model_output: bool
    ) -> list[dict]:
        """One step (a ``StepPlan`` run by ``replay``, see the module docstring) with verl's loss as
        ``integration.loss_calls`` calls it (per replay micro-batch where it is row-additive, else on verl's
        micro-batches with the scores first); returns verl's per-micro-batch outputs (loss, metrics and, where
        asked, the model output)."""
        train = not forward_only
        dp_group = self.get_data_parallel_group()
        trees = build_trees(micro_batches)
        step.stats.vision_splits += vision_splits(trees)
        world = torch.distributed.get_world_size()
        # The trainer's plans (``use_planner`` says only where the trainer got them); none without them.
        entries = [e for mb in micro_batches for e in mb[PLAN_FIELD]] if PLAN_FIELD in micro_batches[0].keys() else None
        step_plan = StepPlan.from_batch(
            trees,
            entries,
            mesh=self.cp_mesh,
            min_cp_tokens=self.engine_config.fallback_threshold_tokens,
            micro_batch_tokens=min(self.engine_config.micro_batch_tokens, _largest_micro_batch(micro_batches)),
            lockstep_group=torch.distributed.group.WORLD if world > 1 else None,
            model_config=text_config(self.module.config),
            trie_cost=cost_model(self.run_profile.profile) if hasattr(self, "run_profile") else None,
            memory=self._replay_memory(train, trees[0].prompt.device),
        )
        offload = self.engine_config.offload_prompt_activations
        options = ReplayOptions(
            temperature=step.temperature,
            entropy_fn=self._entropy if step.want_entropy else None,
            offload=Offload(step.stats) if offload else None,
            stats=step.stats,
        )
        step.plans += step_plan.plans
        step.plan_fallbacks += step_plan.fallbacks
        step.cp_demoted += step_plan.cp_demoted
        model = FSDPReplayModel(self.module)
        row_of = [tree.samples for tree in trees]  # (tree, response) -> row of the micro-batches in order
        coupled = coupling(loss_function, micro_batches[0]) if train else None
        outputs: list[dict] | None = None
        if train and coupled is None:  # row-additive: verl's loss on each replay micro-batch's rows, one pass
            flat = tu.concat_tensordict(micro_batches)

            def micro_batch_loss(t, rows, scores):
                rows_data = tu.index_select_tensor_dict(flat, [row_of[t][i] for i in rows])
                loss, _ = loss_function(
                    model_output=_model_output(rows_data, *_split(scores, step.want_entropy)),
                    data=rows_data,
                    dp_group=dp_group,
                )
                return self._backpropagated(loss)

            scores = replay(model, step_plan, micro_batch_loss, options)
        elif train:  # verl's loss on verl's micro-batches at the scores of a forward-only pass first
            logger.info("augtree: scores first, the loss couples the rows of a call: %s", coupled)
            start = step.stats.start_timer(trees[0].prompt.device)
            first = replay(model, step_plan, None, dataclasses.replace(options, offload=None, stats=ReplayStats()))
            step.stats.stop_timer("scores_first_s", start)
            outputs, adjoints = micro_batch_adjoints(
                micro_batches,
                _rows_in_order(first, trees),
                lambda mb, leaves: _model_output(mb, *_split(leaves, step.want_entropy)),
                loss_function,
                self._backpropagated,
                dp_group,
            )
            scores = replay(model, step_plan, adjoint_loss(lambda t, i: adjoints[row_of[t][i]]), options)
        else:
            scores = replay(model, step_plan, None, options)
        if train:
            model.vision_dummy_backward()
        row_scores = _rows_in_order(scores, trees)

        output_lst = []
        first_row = 0
        for m, mb in enumerate(micro_batches):
            output = _model_output(mb, *_split(row_scores[first_row : first_row + len(mb)], step.want_entropy))
            first_row += len(mb)
            if outputs is not None:
                output_lst.append(outputs[m])
            elif loss_function is None:
                output_lst.append({"loss": 1.0, "metrics": {}})
            else:
                with torch.no_grad():
                    loss, metrics = loss_function(model_output=output, data=mb, dp_group=dp_group)
                output_lst.append({"loss": loss.detach().item(), "metrics": metrics})
            if forward_only or return_model_output:
                output_lst[m]["model_output"] = output
        return output_lst

    def _backpropagated(self, loss: torch.Tensor) -> torch.Tensor:
        """verl's loss as the replay backpropagates it: times the CP size (FSDP averages over the world, a CP
        group is one data-parallel rank), through verl's gradient scaler where it has one."""
        loss = loss * self.cp_mesh.cp_size
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _replay_memory(self, train: bool, device: torch.device) -> ReplayMemory | None:
        """The step's memory check (``replay.memory``): the model's sizes in the dtype its layers compute in
        (the exactness probe's), checkpointing as verl's model config sets it, offload as the engine's, and the
        budget ``replay_memory_budget_gib`` (None: on CPU no check)."""
        budget = device_budget_bytes(self.engine_config.replay_memory_budget_gib, device)
        if budget is None:
            return None
        return ReplayMemory.of(
            self.module.config,  # a vision-language model's whole config: its text sizes and its tower's
            dtype=self.exactness_probe.dtype,
            checkpointing=bool(self.model_config.enable_gradient_checkpointing),
            train=train,
            budget_bytes=budget,
            offload=self.engine_config.offload_prompt_activations,
        )

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy [N] of tempered logits [N, V], computed as verl's stock engine computes it (same knobs)."""
        compute = self.compute_entropy_from_logits
        if self.engine_config.entropy_from_logits_with_chunking:
            compute = functools.partial(compute, chunk_size=self.engine_config.entropy_from_logits_chunk_size)
        if self.engine_config.entropy_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(compute, logits, use_reentrant=False)
        return compute(logits)


class _Step:
    """What one ``forward_backward_batch`` accumulates (for the step's metrics)."""

    def __init__(self, *, temperature: float, want_entropy: bool):
        self.temperature, self.want_entropy = temperature, want_entropy
        self.stats = ReplayStats()
        self.plans: list[Plan | None] = []
        self.plan_fallbacks = 0
        self.cp_demoted = 0  # CP plans run on one device: the model cannot run them (``demote_cp_plans``)


def _check_supported(data: TensorDict) -> None:
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"the augtree engine takes verl's no-padding batches, got pad_mode={pad_mode}")
    for flag in UNSUPPORTED_FLAGS:
        if tu.get_non_tensor_data(data=data, key=flag, default=False):
            raise ValueError(f"the augtree engine does not support {flag}=True")


def _temperature(data: TensorDict) -> float:
    temperature = data["temperature"]
    if isinstance(temperature, torch.Tensor):
        values = temperature.flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"the augtree engine needs one temperature per batch, got {values.tolist()}")
        return float(values[0])
    return float(temperature)


def _rows_in_order(scores: list[list[torch.Tensor]], trees) -> list[torch.Tensor]:
    """``replay``'s ``scores[t][i]`` -> per row of the step's micro-batches in order (``Tree.samples``)."""
    by_row = {row: scores[t][i] for t, tree in enumerate(trees) for i, row in enumerate(tree.samples)}
    return [by_row[row] for row in range(len(by_row))]


def _split(scores: list[torch.Tensor], want_entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``replay``'s per-row scores ([R] log-probs, or [R, 2] with entropies) -> (log-probs, entropies or None)."""
    if not want_entropy:
        return scores, None
    return [s[:, 0] for s in scores], [s[:, 1] for s in scores]


def _model_output(rows: TensorDict, logps: list[torch.Tensor], entropies: list[torch.Tensor] | None) -> dict:
    """verl's model output for the batch ``rows``: per row k its log-probs (and entropies) [R_k]."""
    prompt_lens, _ = sequence_lengths(rows)
    offsets = rows["input_ids"].offsets()
    output = {"log_probs": _full_sequence(logps, prompt_lens, offsets)}
    if entropies is not None:
        output["entropy"] = _full_sequence(entropies, prompt_lens, offsets)
    return output


def _largest_micro_batch(micro_batches: list[TensorDict]) -> int:
    """Tokens (prompt + response per row) of the largest of verl's micro-batches: the stock engine's
    activation bound, which bounds each response micro-batch."""
    return max(sum(p + r for p, r in zip(*sequence_lengths(mb))) for mb in micro_batches)


def _full_sequence(responses: list[torch.Tensor], prompt_lens: list[int], offsets: torch.Tensor) -> torch.Tensor:
    """Per-row response values [R_k] -> verl's nested tensor over each full sequence (offsets [rows + 1]).

    Row k's values sit at positions P_k - 1 .. P_k + R_k - 2 (position j scores token j + 1); the other
    positions are 0. Built with ``torch.cat``, so a graph the values carry reaches the loss.
    """
    pieces = []
    for values, prompt_len in zip(responses, prompt_lens):
        pieces += [values.new_zeros(prompt_len - 1), values, values.new_zeros(1)]
    return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets)
