"""The view of verl's FSDP2-wrapped model that ``augtree_verl.replay`` runs on.

``replay`` calls the decoder (``model.get_decoder()``) and the LM head (``model.get_output_embeddings()``)
separately. Under FSDP2 that needs care, because verl shards the model as: one FSDP unit per decoder layer,
one each for ``embed_tokens`` and ``lm_head`` (untied models), and the root unit holding the rest (the final
norm; with tied embeddings also the embedding / LM head weight):

- Root parameters are only unsharded inside a call of the root module, so every decoder and LM head call
  enters through the root (its ``forward`` is swapped for the duration of the call).
- The call's arguments travel in an opaque box the root does not look into. Otherwise FSDP would register
  its post-backward hook on the LM head's input and reduce the root's gradients as soon as the LM head's
  backward ends, before the final norm's gradient exists; with nothing to hook, the root reduces in FSDP's
  end-of-backward callback, after every gradient of that backward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch


class _Box:
    """Arguments FSDP's root pre-forward must not see (see the module docstring)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def _root_forward(root: torch.nn.Module, target: Callable):
    """Make ``root(box)`` run ``target(*box.args, **box.kwargs)`` inside FSDP's root hooks."""
    root.forward = lambda box: target(*box.args, **box.kwargs)
    try:
        yield
    finally:
        del root.forward


class _ThroughRoot:
    def __init__(self, root: torch.nn.Module, target: Callable):
        self._root, self._target = root, target

    def __call__(self, *args, **kwargs):
        with _root_forward(self._root, self._target):
            return self._root(_Box(args, kwargs))


class FSDPReplayModel:
    """What ``replay`` reads of a causal LM, for verl's FSDP2 root module ``root``."""

    def __init__(self, root: torch.nn.Module):
        self._root = root
        self.config = root.config

    @property
    def training(self) -> bool:
        return self._root.training

    def get_input_embeddings(self):
        return self._root.get_input_embeddings()

    def get_decoder(self):
        return _ThroughRoot(self._root, self._root.get_decoder())

    def get_output_embeddings(self):
        return _ThroughRoot(self._root, self._root.get_output_embeddings())


class UnshardedGroups:
    """What a ZeRO-3 step holds at once on this rank, for a check or a benchmark.

    ``with UnshardedGroups(root) as seen: ...`` samples, whenever a leaf module of ``root`` starts a forward
    (recomputes included) and whenever autograd saves or reads a tensor (i.e. while some layer computes,
    with any prefetched group gathered too):

    - ``seen.max``: the most FSDP2 parameter groups of ``root`` unsharded at once;
    - ``seen.peak_bytes``: the most bytes of unsharded parameters, unsharded gradient buffers (before and
      while FSDP reduce-scatters them) and tensors saved for backward (saved-tensor hooks, each storage
      once, plain tensors only: parameters and nested tensors excluded; inside a checkpointed layer only what the checkpoint itself keeps).
    Sharded parameters, gradients and optimizer state (the same for any schedule) are not counted.
    """

    def __init__(self, root: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self._groups = [g for m in root.modules() if isinstance(m, FSDPModule)
                        for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]
        self._leaves = [m for m in root.modules() if not list(m.children())]
        self._handles: list = []
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive]
        self._saved_bytes = 0
        self.max = 0
        self.peak_bytes = 0

    def _held_bytes(self) -> int:
        total = self._saved_bytes
        for group in self._groups:
            for fp in group.fsdp_params:
                if group.is_unsharded:
                    total += fp._orig_size.numel() * (fp.param_dtype or fp.sharded_param.dtype).itemsize
                grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
                for buffer in (grad, fp.unsharded_accumulated_grad):
                    total += buffer.numel() * buffer.element_size() if buffer is not None else 0
        return total

    def _sample(self, *unused) -> None:
        self.max = max(self.max, sum(g.is_unsharded for g in self._groups))
        self.peak_bytes = max(self.peak_bytes, self._held_bytes())

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        # plain tensors only: parameters are counted as such; nested (loss-side) tensors are small
        if type(x) is torch.Tensor and x.untyped_storage().nbytes() > 0:
            key = x.untyped_storage().data_ptr()
            entry = self._live.setdefault(key, [x.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self._saved_bytes += entry[0]
            entry[1] += 1
            weakref.finalize(x, self._release, key)
        self._sample()
        return x

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self._saved_bytes -= entry[0]
            del self._live[key]

    def _unpack(self, x: torch.Tensor) -> torch.Tensor:
        self._sample()
        return x

    def __enter__(self) -> "UnshardedGroups":
        self._handles = [m.register_forward_pre_hook(self._sample) for m in self._leaves]
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
