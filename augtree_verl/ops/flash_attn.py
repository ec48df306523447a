"""Optional CUDA backend: the flash-attn package's varlen kernels (``AUGTREE_ATTENTION_BACKEND=flash_attn``).

Its private ``_flash_attn_varlen_forward/_backward`` are the functions that take and return lse. Their
calling conventions, by release:

- 2.6: plain Python functions; ``window_size=(left, right)`` as one tuple argument; the forward returns
  8 values (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state), the backward fills dq/dk/dv.
- 2.7 and 2.8: ``torch.library.custom_op`` objects (``inspect.signature`` reads ``(*args, **kwargs)``, so
  keywords cannot be discovered); ``window_size_left, window_size_right`` as two arguments; the forward
  returns 4 values (out, softmax_lse, S_dmask, rng_state), the backward fills dq/dk/dv in place.

One head width D for q, k and v (``ops.attention`` widens attention whose value width differs, ``head_pad``).
Every argument is passed positionally, up to the last one all three releases share, chosen by
``flash_attn.__version__``. Layout and offsets as in ``torch_flash`` (tokens-major, ``Segments``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from augtree_verl.ops.segments import Segments, check_flash_dtype, heads_major, tokens_major

NAME = "flash_attn"
SUPPORTED = ("2.6", "2.7", "2.8")
SETTING = "or unset AUGTREE_ATTENTION_BACKEND to use torch's own flash kernel"


@dataclass(frozen=True)
class FlashAttn:
    """The varlen functions of one flash-attn release; ``split_window``: window as two ints (>= 2.7)."""

    version: str
    fwd: Callable
    bwd: Callable
    split_window: bool

    @classmethod
    def from_module(cls, flash_attn) -> FlashAttn:
        version = str(flash_attn.__version__)
        minor = ".".join(version.split(".")[:2])
        if minor not in SUPPORTED:
            raise ImportError(
                f"flash-attn {version} is not supported (calling conventions known for "
                f"{', '.join(SUPPORTED)}); {SETTING}"
            )
        interface = flash_attn.flash_attn_interface
        return cls(
            version,
            interface._flash_attn_varlen_forward,
            interface._flash_attn_varlen_backward,
            split_window=minor != "2.6",
        )

    def _window(self) -> tuple:
        return (-1, -1) if self.split_window else ((-1, -1),)

    def varlen_forward(self, q, k, v, segments: Segments, causal: bool, scale: float):
        """q [H, Tq, D], k/v [H_kv, Tk, D] packed by ``segments`` -> out [H, Tq, D], lse [H, Tq] (float32)."""
        check_flash_dtype(q, f"flash-attn {self.version}", SETTING)
        cu_q, cu_k = segments.cu_seqlens(q.device)
        outputs = self.fwd(
            tokens_major(q),
            tokens_major(k),
            tokens_major(v),
            cu_q,
            cu_k,
            segments.max_q,
            segments.max_k,
            0.0,
            scale,
            causal,
            *self._window(),
            0.0,
            None,
            False,
        )
        out, lse = (outputs[0], outputs[1]) if self.split_window else (outputs[0], outputs[5])
        return heads_major(out), lse

    def varlen_backward(self, dout, q, k, v, out, lse, segments: Segments, causal: bool, scale: float):
        """dq [H, Tq, D], dk/dv [H_kv, Tk, D] for the (possibly merged) state (out, lse)."""
        check_flash_dtype(q, f"flash-attn {self.version}", SETTING)
        cu_q, cu_k = segments.cu_seqlens(q.device)
        q_, k_, v_ = tokens_major(q), tokens_major(k), tokens_major(v)
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self.bwd(
            tokens_major(dout),
            q_,
            k_,
            v_,
            tokens_major(out),
            lse.contiguous(),
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            segments.max_q,
            segments.max_k,
            0.0,
            scale,
            causal,
            *self._window(),
            0.0,
            None,
            False,
            None,
        )
        return heads_major(dq), heads_major(dk), heads_major(dv)


_LOADED: list[FlashAttn] = []


def load() -> FlashAttn:
    """The installed flash-attn (imported on first use: it has no CPU build and is an optional extra)."""
    if not _LOADED:
        try:
            module = importlib.import_module("flash_attn")
            importlib.import_module("flash_attn.flash_attn_interface")
        except ImportError as e:
            raise ImportError(
                "AUGTREE_ATTENTION_BACKEND=flash_attn needs flash-attn "
                f"(pip install 'augtree-verl[flash-attn]'), {SETTING}"
            ) from e
        _LOADED.append(FlashAttn.from_module(module))
    return _LOADED[0]
