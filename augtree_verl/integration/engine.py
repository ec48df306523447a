"""``AugTreeEngine``: verl's FSDP engine with the update stage run as grouped replay (prompt once per tree).

Everything but ``forward_backward_batch`` is verl's ``FSDPEngineWithLMHead`` (FSDP2 sharding, optimizer,
checkpoints, offload). ``forward_backward_batch`` keeps verl's contract:

- verl's micro-batches are built exactly as verl builds them, and verl's ``loss_function`` is called once
  per micro-batch on them, unchanged, so every loss mode and every metric comes out as with the stock engine;
- ``model_output["log_probs"]`` (and ``["entropy"]`` when asked) are nested over each full sequence, position
  k scoring token k + 1. Only the response part (positions P-1 .. P+R-2) is computed; other positions are 0.

Training runs in two passes, both exact:
1. a forward-only replay of every tree gives the log-probs (and entropies); verl's loss runs on them as
   leaf tensors, and its backward gives dL/dlogp (and dL/dentropy) per token;
2. a training replay with ``loss_fn = sum(dL/dlogp * logp) + sum(dL/dentropy * entropy)`` puts exactly
   verl's gradient into the parameters: the loss depends on the parameters only through log-probs and
   entropies, so the chain rule is all it takes, whatever the loss mode (even batch-coupled ones).
Parameters stay gathered over both passes and gradient sync is held back until one reduction at the end
(``gathered_for_replay``): ranks hold different trees, so per-call FSDP collectives could not line up.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.device import get_device_id
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from augtree_verl.integration.batch_trees import BatchTrees, build_trees, sequence_lengths
from augtree_verl.integration.config import FSDP_STRATEGY, AugTreeEngineConfig
from augtree_verl.integration.entropy_tap import EntropyTap
from augtree_verl.integration.fsdp_model import FSDPReplayModel, gathered_for_replay
from augtree_verl.integration.metrics import step_metrics
from augtree_verl.integration.plans import plans_for_trees
from augtree_verl.replay import ReplayStats, replay

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
        object.__setattr__(self.engine_config, "strategy", FSDP_STRATEGY)
        try:
            return super()._build_fsdp_module(module)
        finally:
            object.__setattr__(self.engine_config, "strategy", requested)

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        if loss_function is None and not forward_only:
            raise ValueError("training (forward_only=False) needs a loss_function")
        _check_supported(data)
        tu.assign_non_tensor(data, sp_size=1)
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        dp_group = self.get_data_parallel_group()
        # Global token count for loss normalisation, as verl's engine computes it.
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=True)
        micro_batches = [mb.to(get_device_id()) for mb in micro_batches]

        grouped = build_trees(micro_batches)
        plans, plan_fallbacks = (plans_for_trees(micro_batches, grouped) if self.engine_config.use_planner
                                 else ([None] * len(grouped.trees), 0))
        temperature = _temperature(data)
        want_entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
        budget = self.engine_config.micro_batch_tokens

        train = not forward_only
        with gathered_for_replay(self.module, reshard_after_forward=self.engine_config.reshard_after_forward,
                                 hold_gradient_sync=train):
            # Pass 1: every response's log-probs (and entropies), forward only.
            start = time.perf_counter()
            score_stats = ReplayStats()
            tap = EntropyTap(grouped.trees, budget, temperature) if want_entropy else None
            with torch.no_grad():
                logps = replay(FSDPReplayModel(self.module, on_logits=tap), grouped.trees, temperature=temperature,
                               plans=plans, micro_batch_tokens=budget, stats=score_stats)
            if tap is not None:
                tap.check_all(logps)
            scoring_s = time.perf_counter() - start

            # verl's loss on each of verl's micro-batches; in training its backward gives dL/dlogp, dL/dentropy.
            output_lst, grads = [], {}
            for m, mb in enumerate(micro_batches):
                model_output, leaves = _model_output(mb, m, grouped, logps, tap, requires_grad=train)
                if loss_function is None:
                    loss, metrics = torch.tensor(1.0), {}
                else:
                    with torch.enable_grad() if train else nullcontext():
                        loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=dp_group)
                    if train:
                        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                        grads.update(_response_grads(mb, m, grouped, leaves))
                entry = {"loss": loss.detach().item(), "metrics": metrics}
                if forward_only or return_model_output:
                    entry["model_output"] = {k: v.detach() for k, v in model_output.items()}
                output_lst.append(entry)

            # Pass 2 (training): replay with the linearised loss; the stats then describe this pass.
            stats = score_stats
            if train:
                stats = ReplayStats()
                self._train_replay(grouped, plans, grads, temperature, want_entropy, stats)
        output_lst[0]["metrics"] = {**output_lst[0]["metrics"],
                                    **step_metrics(stats, plans, scoring_s=scoring_s if train else 0.0,
                                                   plan_fallbacks=plan_fallbacks)}
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _train_replay(self, grouped: BatchTrees, plans, grads, temperature, want_entropy, stats) -> None:
        budget = self.engine_config.micro_batch_tokens
        tap = EntropyTap(grouped.trees, budget, temperature) if want_entropy else None

        def linearised_loss(t: int, i: int, logp: torch.Tensor) -> torch.Tensor:
            g_logp, g_entropy = grads[(t, i)]
            entropy = None
            if tap is not None:
                tap.check(t, i, logp)
                entropy = tap.pop(t, i)
            if not g_logp.any() and (entropy is None or not g_entropy.any()):
                return logp.new_zeros(())  # e.g. a padding sample: nothing to backpropagate
            loss = (g_logp * logp).sum()
            return loss if entropy is None else loss + (g_entropy * entropy).sum()

        replay(FSDPReplayModel(self.module, on_logits=tap), grouped.trees, linearised_loss,
               temperature=temperature, plans=plans, micro_batch_tokens=budget, stats=stats)


def _check_supported(data: TensorDict) -> None:
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=DatasetPadMode.NO_PADDING)
    if pad_mode != DatasetPadMode.NO_PADDING:
        raise ValueError(f"the augtree engine takes verl's no-padding batches, got pad_mode={pad_mode}")
    for flag in UNSUPPORTED_FLAGS:
        if tu.get_non_tensor_data(data=data, key=flag, default=False):
            raise ValueError(f"the augtree engine does not support {flag}=True")
    if "multi_modal_inputs" in data.keys():
        raise ValueError("the augtree engine replays text-only batches; this batch has multi_modal_inputs")


def _temperature(data: TensorDict) -> float:
    temperature = data["temperature"]
    if isinstance(temperature, torch.Tensor):
        values = temperature.flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"the augtree engine needs one temperature per batch, got {values.tolist()}")
        return float(values[0])
    return float(temperature)


def _model_output(mb: TensorDict, m: int, grouped: BatchTrees, logps, tap, *, requires_grad: bool):
    """verl's nested outputs for micro-batch ``m``: log-probs (and entropies) at the response positions.

    Returns ``(model_output, leaves)``: ``leaves[key]`` is the flat float32 [sum of sequence lengths] tensor
    under ``model_output[key]`` (a leaf that collects the loss's gradient when ``requires_grad``).
    """
    seq_lens = mb["input_ids"].offsets().diff().tolist()
    prompt_lens, _ = sequence_lengths(mb)
    offsets = mb["input_ids"].offsets()
    keys = {"log_probs": logps}
    if tap is not None:
        keys["entropy"] = [[tap.entropy[(t, i)] for i in range(len(row))] for t, row in enumerate(logps)]
    out, leaves = {}, {}
    for key, per_tree in keys.items():
        values = torch.zeros(sum(seq_lens), dtype=torch.float32, device=offsets.device)
        start = 0
        for k, seq_len in enumerate(seq_lens):
            t, i = grouped.slot[(m, k)]
            r = per_tree[t][i].shape[0]
            begin = start + prompt_lens[k] - 1
            values[begin: begin + r] = per_tree[t][i].detach()
            start += seq_len
        leaves[key] = values.requires_grad_(requires_grad)
        out[key] = torch.nested.nested_tensor_from_jagged(values, offsets)
    return out, leaves


def _response_grads(mb: TensorDict, m: int, grouped: BatchTrees, leaves: dict) -> dict:
    """(t, i) -> (dL/dlogp [R_i], dL/dentropy [R_i]) from the loss's backward into the leaf outputs."""
    seq_lens = mb["input_ids"].offsets().diff().tolist()
    prompt_lens, response_lens = sequence_lengths(mb)
    grads = {}
    start = 0
    for k, seq_len in enumerate(seq_lens):
        begin = start + prompt_lens[k] - 1
        span = slice(begin, begin + response_lens[k])
        per_key = []
        for key in ("log_probs", "entropy"):
            leaf = leaves.get(key)
            grad = None if leaf is None or leaf.grad is None else leaf.grad[span]
            per_key.append(grad if grad is not None else torch.zeros(response_lens[k], device=mb["input_ids"].device))
        grads[grouped.slot[(m, k)]] = tuple(per_key)
        start += seq_len
    return grads
