"""Packed variable-length blocks: many (query, key) segment pairs in one kernel call.

``Segments`` describes B independent attention segments packed along the token axis: segment b's
queries are rows ``q_offsets[b] : q_offsets[b + 1]`` of q [H, Tq, D_k] and its keys rows
``k_offsets[b] : k_offsets[b + 1]`` of k [H_kv, Tk, D_k] and v [H_kv, Tk, D_v]. The caller builds it from
Python lengths; the device offsets (``cu_seqlens``, int32 [B + 1]) are made at most once per ``Segments``
and device and never copied back, so a kernel call launches without a host sync:

- equal-length segments (``Segments.uniform``: one block, or the padded rows of a micro-batch) are
  memoised by shape, so every layer and every later call of that shape reuses the same offsets, made
  by ``torch.arange`` (a kernel, no host-to-device copy);
- ragged segments: one pinned, non-blocking host-to-device copy per ``Segments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

# The flash kernels (torch's and flash-attn's) only run half precision on CUDA.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Segments:
    """``q_lens[b]`` queries attend to ``k_lens[b]`` keys, for b in 0..B-1 (every length >= 1)."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    _offsets: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if len(self.q_lens) != len(self.k_lens) or not self.q_lens:
            raise ValueError(
                f"Segments need one key length per query length and at least one segment, got "
                f"q_lens {self.q_lens}, k_lens {self.k_lens}"
            )
        if min(self.q_lens) < 1 or min(self.k_lens) < 1:
            raise ValueError(f"Segments with no queries or no keys: q_lens {self.q_lens}, k_lens {self.k_lens}")

    @staticmethod
    def uniform(count: int, q_len: int, k_len: int) -> Segments:
        """``count`` segments of ``q_len`` queries against ``k_len`` keys each (memoised by shape)."""
        return _uniform(count, q_len, k_len)

    @property
    def count(self) -> int:
        return len(self.q_lens)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.q_lens)) == 1 and len(set(self.k_lens)) == 1

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_k(self) -> int:
        return max(self.k_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_k(self) -> int:
        return sum(self.k_lens)

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q, cu_seqlens_k), int32 [B + 1] on ``device``; built once per device."""
        device = torch.device(device)
        if device not in self._offsets:
            self._offsets[device] = (_offsets(self.q_lens, device), _offsets(self.k_lens, device))
        return self._offsets[device]

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if q.shape[1] != self.total_q or k.shape[1] != self.total_k:
            raise ValueError(
                f"packed q has {q.shape[1]} rows and k {k.shape[1]}, but the Segments hold "
                f"{self.total_q} queries and {self.total_k} keys"
            )


@lru_cache(maxsize=1024)
def _uniform(count: int, q_len: int, k_len: int) -> Segments:
    return Segments((q_len,) * count, (k_len,) * count)


def _offsets(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if len(set(lengths)) == 1:
        n = lengths[0]
        return torch.arange(0, n * len(lengths) + 1, n, dtype=torch.int32, device=device)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    host = torch.tensor(offsets, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def check_flash_dtype(q: torch.Tensor, backend: str, setting: str) -> None:
    """The CUDA flash kernels take float16/bfloat16 only: a clear error naming the dtype and the setting."""
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(
            f"CUDA attention got {q.dtype} tensors, but the {backend} flash kernel takes only "
            f"float16/bfloat16 (its log-sum-exp is float32 either way): run the model in bfloat16 "
            f"(model.to(torch.bfloat16), or verl's fsdp_config.mixed_precision.param_dtype=bf16); "
            f"{setting}"
        )


def tokens_major(x: torch.Tensor) -> torch.Tensor:
    """[H, T, D] -> contiguous [T, H, D] (the varlen kernels' layout)."""
    return x.transpose(0, 1).contiguous()


def heads_major(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [H, T, D] (a view)."""
    return x.transpose(0, 1)
