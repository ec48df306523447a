"""Prompt-activation offload: a prompt's saved activations wait in host memory for its delayed backward.

Lifecycle (one object per ``replay`` call, or per engine step; prompts restored in the order they were saved)::

    offload = Offload(stats)
    with offload.saving():       # phase A, the prompt's forward: what autograd saves moves to the host
        hidden = model(prompt)
    ...                          # phase B: the responses replay; the prompt's activations are on the host
    with offload.restoring():    # phase C, the prompt's delayed backward (the oldest saving() not restored)
        torch.autograd.backward(roots, grads)

What moves. Every tensor autograd saves inside ``saving()`` passes ``_pack`` (with activation checkpointing,
non-reentrant, that is each checkpointed layer's input hidden states [1, P, hidden], the boundaries, and what
the layers outside checkpoints save, e.g. the final norm's [1, P, hidden] inputs; without it, every
activation). It stays on the device, untouched, when it is a parameter or a view of one (FSDP2's unsharded
parameters are ``nn.Parameter``s), a leaf that requires grad, not a plain strided tensor (subclasses, nested,
sparse, quantized, lazily conjugated or negated), or its storage is
smaller than ``min_bytes`` (``MIN_OFFLOAD_BYTES``). Otherwise its whole storage is copied to the host (once
per storage: views saved from one storage share one host copy and come back as views of one restored
storage, with the saved dtype, shape, strides and offset). At the end of ``saving()`` a storage that is still
alive (something else holds it: the prompt K/V, which SDPA saves without checkpointing and which stay on the
device as the responses' leaves) is kept on the device and its host copy dropped: moving it would free
nothing.

CUDA: host buffers are pinned; device-to-host copies (at pack) and host-to-device copies (prefetch) run on
one side stream, which orders them; the compute stream waits on an event only where it uses a restored
storage, and the side stream waits on the compute stream (``wait_stream``) before each copy. No host sync.
CPU: the host copies form a separate pool (``host_bytes``), so a meter can count device vs host bytes.

Prefetch. The backward unpacks roughly in reverse order of packing. ``restoring()`` starts copying back the
last-packed storages; each unpack then keeps at least ``ahead_bytes`` of the storages packed before it
copied back or in flight (default: the prompt's largest offloaded storage, i.e. one checkpoint boundary, one
layer, under checkpointing), so the copy of layer l - 1 overlaps layer l's backward. A restored storage stays
on the device until each tensor saved from it has been unpacked once. Unpacking outside ``restoring()`` works
too (copies on demand).

Counters: ``stats.offloaded_bytes`` (bytes held on the host instead of the device, summed over prompts),
``stats.prefetched_bytes`` (host-to-device bytes copied ahead of their use), ``stats.offload_copies`` (copies
in both directions); ``host_bytes`` / ``peak_host_bytes`` (the host pool now / at most); ``device_storages()``
(what the object keeps on the device now, for memory meters: ``live_offloads()``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import torch

from augtree_verl.replay.stats import ReplayStats

# Storages smaller than this (256 KiB) stay on the device: a copy this small is latency-bound (a few microseconds
# each way) and frees little (at 28k tokens a boundary is ~200 MB; a norm's [P, 1] statistics ~100 kB).
MIN_OFFLOAD_BYTES = 1 << 18

_LIVE: weakref.WeakSet[Offload] = weakref.WeakSet()


def live_offloads() -> list[Offload]:
    """The ``Offload`` objects alive now (for memory meters)."""
    return list(_LIVE)


class _Storage:
    """One offloaded storage: its host copy, its restored device copy, how many saved tensors still need it."""

    __slots__ = ("index", "nbytes", "device", "ref", "host", "resident", "restored", "event", "pending", "ahead")

    def __init__(self, index: int, storage: torch.UntypedStorage, device: torch.device):
        self.index, self.nbytes, self.device = index, storage.nbytes(), device
        self.ref = weakref.ref(storage)  # the device storage, while anything keeps it alive
        self.host: torch.Tensor | None = None  # uint8 [nbytes]
        self.resident: torch.UntypedStorage | None = None  # kept on the device (still alive at saving()'s end)
        self.restored: torch.Tensor | None = None  # uint8 [nbytes] on the device, copied back
        self.event = None  # CUDA: the copy back's completion
        self.pending = 0  # saved tensors not unpacked yet
        self.ahead = False  # restored by prefetch, not used yet


class _Record:
    """One ``saving()`` block: its offloaded storages in pack order, and what it left on the device."""

    def __init__(self):
        self.storages: list[_Storage] = []
        self.by_ptr: dict[int, _Storage] = {}
        self.kept: list[weakref.ref] = []  # device storages of small saved tensors left in place
        self.cursor = 0  # storages[cursor:] have been considered for copying back
        self.in_flight = 0  # bytes copied back ahead of use, not used yet
        self.ahead_limit = 0


class _Handle:
    """What autograd keeps for one offloaded saved tensor."""

    __slots__ = ("record", "storage", "dtype", "size", "stride", "offset", "done")

    def __init__(self, record: _Record, storage: _Storage, x: torch.Tensor):
        self.record, self.storage = record, storage
        self.dtype, self.size, self.stride, self.offset = x.dtype, x.size(), x.stride(), x.storage_offset()
        self.done = False


class Offload:
    """Moves prompts' saved activations to host memory between their forward and their delayed backward.

    ``stats``: where the counters go (a fresh ``ReplayStats`` if None). ``min_bytes``: storages below it stay
    on the device (default ``MIN_OFFLOAD_BYTES``). ``ahead_bytes``: how much to keep copied back ahead of the
    backward (default: the prompt's largest offloaded storage). See the module docstring.
    """

    def __init__(
        self, stats: ReplayStats | None = None, *, min_bytes: int | None = None, ahead_bytes: int | None = None
    ):
        min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"Offload.min_bytes must be an int >= 0, got {min_bytes!r}")
        if ahead_bytes is not None and (
            isinstance(ahead_bytes, bool) or not isinstance(ahead_bytes, int) or ahead_bytes < 0
        ):
            raise ValueError(f"Offload.ahead_bytes must be None or an int >= 0, got {ahead_bytes!r}")
        self.stats = stats if stats is not None else ReplayStats()
        self.min_bytes, self.ahead_bytes = min_bytes, ahead_bytes
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._saving: _Record | None = None
        self._waiting: collections.deque[_Record] = collections.deque()
        self._restoring: _Record | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        _LIVE.add(self)

    # ---- the two phases ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self):
        """Around a prompt's forward: its saved activations move to the host (see the module docstring)."""
        if self._saving is not None:
            raise ValueError("Offload.saving() blocks do not nest")
        record = self._saving = _Record()
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, record), self._unpack):
                yield
        finally:
            self._saving = None
        self._settle(record)
        self._waiting.append(record)

    @contextlib.contextmanager
    def restoring(self):
        """Around the delayed backward of the oldest prompt saved and not yet restored: copies its activations
        back ahead of the backward's use."""
        if not self._waiting:
            raise ValueError("Offload.restoring() needs a prompt saved by saving() and not restored yet")
        record = self._restoring = self._waiting.popleft()
        record.cursor = len(record.storages)
        self._prefetch(record)
        try:
            yield
        finally:
            self._restoring = None
            for storage in record.storages:  # what the backward did not use goes back to the host copy
                storage.restored, storage.event, storage.ahead = None, None, False

    def device_storages(self) -> list[torch.UntypedStorage]:
        """The device storages this object keeps alive or left in place now: small saved tensors, storages
        kept on the device, storages copied back (may repeat a storage; meters deduplicate)."""
        out = []
        records = (
            ([self._saving] if self._saving else [])
            + list(self._waiting)
            + ([self._restoring] if self._restoring else [])
        )
        for record in records:
            out += [s for s in (ref() for ref in record.kept) if s is not None]
            for storage in record.storages:
                if storage.resident is not None:
                    out.append(storage.resident)
                elif storage.restored is not None:
                    out.append(storage.restored.untyped_storage())
        return out

    # ---- saved-tensor hooks -----------------------------------------------------------------------------

    def _pack(self, record: _Record, x: torch.Tensor):
        if (
            type(x) is not torch.Tensor
            or x.is_nested
            or x.layout != torch.strided
            or x.is_quantized
            or x.is_conj()
            or x.is_neg()
            or isinstance(x._base, torch.nn.Parameter)
            or (x.is_leaf and x.requires_grad)
        ):
            # parameters and views of them, leaves, subclasses (DTensor, nested), sparse, quantized, lazily
            # conjugated / negated views (a storage copy would not carry the bit): not ours to move
            return x
        if x.untyped_storage().nbytes() < max(self.min_bytes, 1):
            record.kept.append(weakref.ref(x.untyped_storage()))
            return x
        storage = x.untyped_storage()
        entry = record.by_ptr.get(storage.data_ptr())
        if entry is None or entry.ref() is not storage:  # a new storage (or a dead one's address reused)
            entry = _Storage(len(record.storages), storage, x.device)
            self._to_host(entry, storage)
            record.storages.append(entry)
            record.by_ptr[storage.data_ptr()] = entry
        entry.pending += 1
        return _Handle(record, entry, x)

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        entry, record = packed.storage, packed.record
        if entry.resident is not None:
            storage = entry.resident
        else:
            if entry.restored is None:
                self._to_device(entry, ahead=False)
            if entry.ahead:
                entry.ahead = False
                record.in_flight -= entry.nbytes
            self._prefetch(record)
            if entry.event is not None:
                torch.cuda.current_stream(entry.device).wait_event(entry.event)
                entry.event = None
            storage = entry.restored.untyped_storage()
        if not packed.done:
            packed.done = True
            entry.pending -= 1
            if entry.pending == 0:  # every tensor saved from it has its copy: the backward holds it from here
                entry.restored = None
        return torch.empty(0, dtype=packed.dtype, device=entry.device).set_(
            storage, packed.offset, packed.size, packed.stride
        )

    # ---- copies -----------------------------------------------------------------------------------------

    def _settle(self, record: _Record) -> None:
        """End of a prompt's forward: storages still alive stay on the device; fix the prefetch window."""
        for entry in record.storages:
            alive = entry.ref()
            if alive is not None:
                entry.resident, entry.host = alive, None
                self.stats.offloaded_bytes -= entry.nbytes
        offloaded = [e.nbytes for e in record.storages if e.resident is None]
        record.ahead_limit = self.ahead_bytes if self.ahead_bytes is not None else max(offloaded, default=0)
        record.by_ptr.clear()

    def _prefetch(self, record: _Record) -> None:
        """Copy back storages packed before ``record.cursor`` until ``ahead_limit`` bytes are in flight."""
        while record.cursor > 0 and record.in_flight < record.ahead_limit:
            record.cursor -= 1
            entry = record.storages[record.cursor]
            if entry.resident is None and entry.restored is None and entry.pending > 0:
                self._to_device(entry, ahead=True)
                entry.ahead = True
                record.in_flight += entry.nbytes

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def _to_host(self, entry: _Storage, storage: torch.UntypedStorage) -> None:
        src = torch.empty(0, dtype=torch.uint8, device=entry.device).set_(storage)
        if entry.device.type == "cuda":
            host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            stream = self._side_stream(entry.device)
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
            src.record_stream(stream)  # the allocator must not reuse the source until the copy has run
        else:
            host = src.clone()
        entry.host = host
        self.host_bytes += entry.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(host, self._host_freed, entry.nbytes)
        self.stats.offloaded_bytes += entry.nbytes
        self.stats.offload_copies += 1

    def _host_freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _to_device(self, entry: _Storage, *, ahead: bool) -> None:
        if entry.host is None:
            raise ValueError("an offloaded activation was unpacked after its host copy was released")
        dev = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)  # on the compute stream
        if entry.device.type == "cuda":
            stream = self._side_stream(entry.device)  # after the compute stream's last use of that memory
            with torch.cuda.stream(stream):
                dev.copy_(entry.host, non_blocking=True)
            dev.record_stream(stream)  # freed unused (restoring() ends) before the copy ran: still safe
            entry.event = torch.cuda.Event()
            entry.event.record(stream)
        else:
            dev.copy_(entry.host)
        entry.restored = dev
        self.stats.offload_copies += 1
        if ahead:
            self.stats.prefetched_bytes += entry.nbytes
