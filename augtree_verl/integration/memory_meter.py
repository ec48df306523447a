"""``UnshardedGroups``: what a ZeRO-3 training step holds at once on this rank, for a check or a benchmark."""

from __future__ import annotations

import weakref

import torch

from augtree_verl.replay import held_prompt_tensors
from augtree_verl.replay.offload import live_offloads


class UnshardedGroups:
    """``with UnshardedGroups(root) as seen: ...`` samples whenever a leaf module of ``root`` starts a forward
    (recomputes included) and whenever autograd saves or reads a tensor (i.e. while some layer computes, with
    any prefetched group gathered too):

    - ``seen.max``: the most FSDP2 parameter groups of ``root`` unsharded at once;
    - ``seen.peak_bytes``: the most device bytes of, each storage counted once:
      * unsharded parameters and unsharded gradient buffers (before and while FSDP reduce-scatters them);
      * tensors saved for backward that are on the device: those this meter's saved-tensor hooks see (plain
        tensors; parameters and views of parameters excluded; inside a checkpointed layer only what the
        checkpoint itself keeps); and, since saved-tensor hooks stack and only the innermost pair runs, for a
        prompt forward under an ``Offload.saving()`` what the live ``Offload`` objects report they keep on
        the device (``Offload.device_storages``: small saved tensors, storages left in place, storages copied
        back for the backward); their host copies are not device bytes;
      * the tensors in-flight prompts hold between their prefill and their delayed backward
        (``replay.held_prompt_tensors``: K/V leaves, last hidden states, their float32 gradient sums);
    - ``seen.peak_host_bytes``: the most bytes in the live ``Offload`` objects' host pools.
    Not counted: sharded parameters, gradients and optimizer state (the same for any schedule), a layer's
    working tensors that are not saved for backward, and allocator caching.
    """

    def __init__(self, root: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self._groups = [
            g
            for m in root.modules()
            if isinstance(m, FSDPModule)
            for g in [m._get_fsdp_state()._fsdp_param_group]
            if g is not None
        ]
        self._leaves = [m for m in root.modules() if not list(m.children())]
        self._handles: list = []
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive]
        self.max = 0
        self.peak_bytes = 0
        self.peak_host_bytes = 0

    def _held_bytes(self) -> int:
        total = 0
        for group in self._groups:
            for fp in group.fsdp_params:
                if group.is_unsharded:
                    total += fp._orig_size.numel() * (fp.param_dtype or fp.sharded_param.dtype).itemsize
                grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
                for buffer in (grad, fp.unsharded_accumulated_grad):
                    total += buffer.numel() * buffer.element_size() if buffer is not None else 0
        storages = {ptr: entry[0] for ptr, entry in self._live.items()}
        for storage in [t.untyped_storage() for t in held_prompt_tensors()] + [
            s for offload in live_offloads() for s in offload.device_storages()
        ]:
            storages[storage.data_ptr()] = storage.nbytes()
        return total + sum(storages.values())

    def _sample(self, *unused) -> None:
        self.max = max(self.max, sum(g.is_unsharded for g in self._groups))
        self.peak_bytes = max(self.peak_bytes, self._held_bytes())
        self.peak_host_bytes = max(self.peak_host_bytes, sum(o.host_bytes for o in live_offloads()))

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        # plain tensors only: parameters (and views of them) are counted as such; nested (loss-side) tensors
        # are small
        if type(x) is torch.Tensor and not isinstance(x._base, torch.nn.Parameter) and x.untyped_storage().nbytes() > 0:
            key = x.untyped_storage().data_ptr()
            entry = self._live.setdefault(key, [x.untyped_storage().nbytes(), 0])
            entry[1] += 1
            weakref.finalize(x, self._release, key)
        self._sample()
        return x

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]

    def _unpack(self, x: torch.Tensor) -> torch.Tensor:
        self._sample()
        return x

    def __enter__(self) -> UnshardedGroups:
        self._handles = [m.register_forward_pre_hook(self._sample) for m in self._leaves]
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
