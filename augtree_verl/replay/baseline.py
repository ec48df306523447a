"""The oracle: the flattened baseline, each [prompt || response] run as its own full sequence.

It shares nothing with the engine it checks but the tree type: its model calls, log-probs and losses are
its own (plain Hugging Face calls and ``torch.log_softmax``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from augtree_verl.groups import MROPE_AXES, Tree

LogitsHook = Callable[[int, int, torch.Tensor], None]  # on_logits(t, i, tempered float32 logits [R_i, V])
LossFn = Callable[[int, int, torch.Tensor], torch.Tensor]  # loss_fn(t, i, log-probs [R_i]) -> scalar loss


def flattened_replay(
    model,
    trees: Sequence[Tree],
    loss_fn: LossFn | None = None,
    *,
    temperature: float = 1.0,
    keep_graph: bool = False,
    on_logits: LogitsHook | None = None,
    mrope: bool = False,
) -> list[list[torch.Tensor]]:
    """Same contract as ``replay``, computed the way stock trainers do: one sequence per response.

    ``mrope``: the model is a vision-language model, called as verl's engine calls it on a text-only row: position
    ids [4, 1, L] (text positions on the three M-RoPE axes, all 0..L-1) and every position's logits (verl's forward
    for these models takes no ``logits_to_keep``). A tree with images (``tree.vision``) is called so on any model,
    with its ``pixel_values`` and ``image_grid_thw`` and its prompt's positions, which each response continues
    (``Vision``: text position k, k + shift on the M-RoPE axes)."""
    logps = []
    with torch.set_grad_enabled(loss_fn is not None or keep_graph):
        for t, tree in enumerate(trees):
            row = []
            for i, resp in enumerate(tree.responses):
                ids = torch.cat([tree.prompt, resp])[None]
                # Keep the logits of positions P-1 .. P+R-2, the ones that score the response.
                keep = len(resp) + 1
                if tree.vision is not None:
                    vision = tree.vision
                    after = torch.arange(tree.prompt_len, ids.shape[1], device=ids.device).expand(MROPE_AXES, -1)
                    after = after + torch.tensor([0] + [vision.shift] * (MROPE_AXES - 1), device=ids.device)[:, None]
                    positions = torch.cat([vision.positions.to(ids.device), after], dim=1)[:, None]
                    images = dict(pixel_values=vision.pixels, image_grid_thw=vision.grid_thw)
                    logits = model(input_ids=ids, position_ids=positions, use_cache=False, **images).logits
                    logits = logits[0, -keep:-1]
                elif mrope:
                    positions = torch.arange(ids.shape[1], device=ids.device).expand(MROPE_AXES, 1, -1)
                    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, -keep:-1]
                else:
                    logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[0, :-1]
                hook = None if on_logits is None else (lambda x, t=t, i=i: on_logits(t, i, x))
                logits = logits.float() / temperature
                if hook is not None:
                    hook(logits)
                logp = torch.log_softmax(logits, dim=-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
                if loss_fn is not None:
                    loss_fn(t, i, logp).backward()
                row.append(logp if keep_graph else logp.detach())
            logps.append(row)
    return logps
