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
        """Raise ``ValueError`` naming tree ``index`` (and the response) for any malformed input."""
        _check_ids(self.prompt, f"tree {index} prompt", vocab_size, device)
        if len(self.responses) == 0:
            raise ValueError(f"tree {index} has no responses")
        for i, r in enumerate(self.responses):
            _check_ids(r, f"tree {index} response {i}", vocab_size, device)


def _check_ids(t, what: str, vocab_size: int, device: torch.device) -> None:
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
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what} has token id {bad} outside the vocabulary [0, {vocab_size})")
