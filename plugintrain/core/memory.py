"""Live tensor memory, measured by something that sees every tensor.

On CUDA the caching allocator already counts every byte
(``torch.cuda.max_memory_allocated``). On CPU nothing does, so :class:`LiveTensorMemory`
is a ``TorchDispatchMode`` that sees the output of every operator run under it (factory
functions, views, in-place ops, autograd's backward, collectives' buffers), follows each
distinct storage from its first appearance until it is freed (a weak reference to the
storage), and keeps the running total and its peak. Storages that existed before the
mode (parameters, optimizer state) are counted once registered with :meth:`track`.

Views and tensors sharing a storage count once, by storage size, as the allocator would.
A DTensor counts as its local shard (a wrapper has no storage of its own; the mode sees
the op on the DTensor, not the local op it runs).
A storage is counted from the operator that allocated it (an output that does not alias
an input, or a tensor adopting a storage, as ``torch.load`` builds what it reads); views
of storages the mode never saw allocated (weights created before it, buffers a
communication backend allocates internally) are not counted unless registered with
:meth:`track`.
A storage stays counted until it is freed, also when the last owner is not Python: gloo
drops a collective's tensors on its worker thread, after the caller saw it complete.
Use it in tests and benchmarks::

    with LiveTensorMemory() as memory:
        memory.track(*model.parameters())
        loss = model(x).sum(); loss.backward()
    memory.peak_bytes, memory.live_bytes

:func:`measure_peak` wraps this for either device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_ADOPT_STORAGE = (
    torch.ops.aten.set_.source_Storage,
    torch.ops.aten.set_.source_Storage_storage_offset,
)


def _storage_ptrs(value: Any) -> set[int]:
    """Keys of the storages ``value`` (a tensor, a DTensor's local shard) holds: their
    addresses, or on the meta device (no addresses) the storages' C++ objects."""
    if not isinstance(value, Tensor):
        return set()
    if is_traceable_wrapper_subclass(value):
        return {
            p for attr in value.__tensor_flatten__()[0] for p in _storage_ptrs(getattr(value, attr))
        }
    storage = value.untyped_storage()
    ptr = storage._cdata if value.is_meta else storage.data_ptr()
    return {ptr} if ptr else set()


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local shards;
    None, a parameter without a gradient, counts nothing), on any device, the meta device
    included: a storage is told apart by its C++ object, which views share."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


class LiveTensorMemory(TorchDispatchMode):
    """Bytes of live tensor storage on one device type (``"cpu"`` by default; ``"meta"``
    counts the bytes unallocated tensors would take), with the peak.

    Attributes:
        live_bytes: Bytes of the storages currently alive that the mode has seen.
        peak_bytes: The most ``live_bytes`` reached since entering (or :meth:`reset_peak`).
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # key of a live storage -> bytes counted
        self._refs: dict[int, weakref.ref] = {}

    def track(self, *tensors: Tensor | Iterable[Tensor]) -> None:
        """Count storages created before the mode (parameters, buffers, optimizer state)."""
        for item in tensors:
            if isinstance(item, Tensor):
                self._see(item)
            else:
                for tensor in item:
                    self._see(tensor)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = tree_flatten((args, kwargs))[0]
        held = {ptr for value in inputs for ptr in _storage_ptrs(value)}  # before the op
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        # An output that aliases an input (a view, an in-place or `out=` result, or an input
        # a mutating op hands back, as `_foreach_add_` and c10d collectives do without
        # saying so in their schema) is no new allocation...
        aliasing = any(ret.alias_info is not None for ret in schema.returns)
        # ...except a tensor adopting a fresh storage: how torch.load (and so DCP's reader)
        # materializes what it reads.
        aliasing = aliasing and func not in _ADOPT_STORAGE
        for value in tree_flatten(out)[0]:
            if isinstance(value, Tensor):
                self._see(value, new=not aliasing and not (_storage_ptrs(value) & held))
        if schema.is_mutable:  # re-measure what it changed in place (resize_ can grow one)
            for value in inputs:
                if isinstance(value, Tensor):
                    self._see(value, new=False)
        return out

    def _see(self, tensor: Tensor, new: bool = True) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # A DTensor (or another wrapper) owns no storage of its own: its inner tensors
            # do, and the ops on them run where this mode does not see them.
            for attr in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, attr)
                if isinstance(inner, Tensor):
                    self._see(inner, new)
            return
        if tensor.device.type != self.device_type:  # "meta": a dry run's unallocated tensors
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        size = storage.nbytes()
        known = self._sizes.get(key)
        if known is None and not new:
            return
        if known is None:
            # The id may be reused by a new storage once the old one died: the weakref's
            # callback removes the old entry first, so a live key is always the same storage.
            self._refs[key] = weakref.ref(storage, self._forget(key))
        elif known == size:
            return
        self.live_bytes += size - (known or 0)
        self._sizes[key] = size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        def forget(_: weakref.ref) -> None:
            self.live_bytes -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

        return forget


def measure_peak(fn: Callable[[], Any], device: torch.device, *existing: Iterable[Tensor]) -> int:
    """Peak bytes of live tensors on ``device`` while ``fn()`` runs, ``existing`` included.

    CUDA: the allocator's peak (every tensor of the process on that device). CPU: a
    :class:`LiveTensorMemory` that counts ``existing`` and everything ``fn`` creates.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with LiveTensorMemory(device.type) as memory:
        memory.track(*existing)
        fn()
    return memory.peak_bytes
