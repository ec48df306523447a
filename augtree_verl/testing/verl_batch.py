"""verl's V1 batch from plain rows, and the response part of its outputs (for tests, benchmarks and GPU checks)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from augtree_verl.groups import MROPE_AXES


def rows_to_batch(
    rows: list[dict],
    *,
    old_log_probs: list[torch.Tensor] | None = None,
    extra: dict[str, list] | None = None,
    mrope: bool = False,
    **settings,
) -> TensorDict:
    """``rows[k] = {uid, prompt, response, advantage}`` -> the TensorDict verl's engines take (jagged nested
    tensors over prompt + response, no padding).

    ``old_log_probs``: one [R_k] tensor per row (zeros if omitted). ``extra[key]``: one non-tensor value per row
    (e.g. the trainer's plan entries). ``mrope``: position ids [4, L] per row, as verl's agent loop builds them for
    a text-only row on an M-RoPE vision-language model (its text positions on the three M-RoPE axes of
    ``get_rope_index``, all 0..L-1 without images); else [L]; a row's own ``positions`` ([4, L]: a row with images,
    ``get_rope_index``'s as verl's agent loop stacks them) replace those. ``settings``: the non-tensor knobs verl's
    engine and loss read (``temperature``, ``use_dynamic_bsz``, ``micro_batch_size_per_gpu`` or
    ``max_token_len_per_gpu``, ``calculate_entropy``, ...), over defaults for remove-padding, unfused kernels,
    temperature 1.
    """
    from verl.utils import tensordict_utils as tu

    def nested(tensors):
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    seqs = [torch.cat([row["prompt"], row["response"]]) for row in rows]
    positions = [
        row.get("positions", torch.arange(len(s)).expand(MROPE_AXES, -1) if mrope else torch.arange(len(s)))
        for row, s in zip(rows, seqs)
    ]
    responses = [row["response"] for row in rows]
    olds = old_log_probs if old_log_probs is not None else [torch.zeros(len(r)) for r in responses]
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(seqs),
            "position_ids": nested(positions),
            "attention_mask": nested([torch.ones(len(s), dtype=torch.int64) for s in seqs]),
            "prompts": nested([row["prompt"] for row in rows]),
            "responses": nested(responses),
            "response_mask": nested([torch.ones(len(r), dtype=torch.int64) for r in responses]),
            "loss_mask": nested([torch.ones(len(r), dtype=torch.int64) for r in responses]),
            "old_log_probs": nested(olds),
            "advantages": nested([torch.full((len(r),), float(row["advantage"])) for r, row in zip(responses, rows)]),
            "uid": [row["uid"] for row in rows],
            **(extra or {}),
        },
        non_tensor_dict={
            "temperature": 1.0,
            "global_batch_size": len(rows),
            "use_remove_padding": True,
            "use_fused_kernels": False,
            "calculate_entropy": False,
            **settings,
        },
    )


def response_values(output: dict, batch: TensorDict, key: str = "log_probs") -> list[torch.Tensor]:
    """Per row, the response part of a nested model output: position k scores token k + 1."""
    values = output["model_output"][key]
    seq_lens = batch["input_ids"].offsets().diff().tolist()
    resp_lens = batch["responses"].offsets().diff().tolist()
    return [v[s - r - 1 : s - 1] for v, s, r in zip(values.unbind(), seq_lens, resp_lens)]
