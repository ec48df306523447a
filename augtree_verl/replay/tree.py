"""A replay tree: one prompt and the G responses sampled from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReplayTree:
    """``prompt``: LongTensor [P]; ``responses``: G LongTensors [R_i] (token ids, same device as the model)."""

    prompt: torch.Tensor
    responses: list[torch.Tensor]

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def response_lens(self) -> list[int]:
        return [int(r.shape[0]) for r in self.responses]

    def validate(self, index: int, vocab_size: int, device: torch.device) -> None:
        """Raise ``ValueError`` naming tree ``index`` (and the response) for any malformed input.

        The vocabulary range of all the tree's ids is read in one device-to-host copy (one host sync per
        tree, before any kernel runs), not one per sequence."""
        _check_ids(self.prompt, f"tree {index} prompt", device)
        if len(self.responses) == 0:
            raise ValueError(f"tree {index} has no responses")
        for i, r in enumerate(self.responses):
            _check_ids(r, f"tree {index} response {i}", device)
        ids = [self.prompt, *self.responses]
        bounds = torch.stack([torch.stack([t.min(), t.max()]) for t in ids]).tolist()
        for j, (lo, hi) in enumerate(bounds):
            if lo < 0 or hi >= vocab_size:
                what = f"tree {index} prompt" if j == 0 else f"tree {index} response {j - 1}"
                raise ValueError(f"{what} has token id {lo if lo < 0 else hi} outside the vocabulary "
                                 f"[0, {vocab_size})")


def _check_ids(t, what: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of token ids, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must hold integer token ids, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{what} is on {t.device} but the model is on {device}")
