"""The ``OffloadedTensor`` class: the tensor subclass bound to a payload file (see the package)."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import itertools
import logging
import multiprocessing.context
import multiprocessing.util
import os
import shutil
import sys
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import torch

from torch_to_nnef._forksafe import fork_safe_lock
from torch_to_nnef._interrupts import InterruptHold
from torch_to_nnef._owned import held_here, owned_lock
from torch_to_nnef._waiting import Waiters
from torch_to_nnef.exceptions import (
    T2NErrorCheckpoint,
    T2NErrorInconsistentTensor,
    T2NErrorMisuse,
    T2NErrorNotImplemented,
    T2NErrorStorage,
    T2NErrorValueMismatch,
)
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload._protocol import (
    HitState,
    PoolSource,
    ScopePool,
    active_tensor_residency,
    count_load_outside_scopes,
)
from torch_to_nnef.tensor.opaque import (
    OpaqueTensor,
    SupportsOffloadState,
    _call_on_values,
    _is_tracing,
    _remember,
    _runs_expanded,
    _writes_first_argument,
    opaque_to_final_tensor,
)
from torch_to_nnef.tensor.storage._buffers import refuse_unstorable
from torch_to_nnef.tensor.storage._format import file_identity
from torch_to_nnef.tensor.storage._paths import path_argument

__all__ = ["OffloadedTensor"]

_R = TypeVar("_R")
LOGGER = logging.getLogger(__name__)

DeviceLike = torch.device | str | int
PathLike = str | os.PathLike[str]

_PLAIN_ENTRY = "tensor"
"""Entry name of a plain payload written by an OffloadedTensor (and its logical name)."""

_CPU = torch.device("cpu")

_READ_ATTEMPTS = 3
"""Reads of a payload replaced by concurrent writes are retried this many times in all."""


# ---------------------------------------------------------------------------------------------
# Files and directories owned by offloaded tensors
# ---------------------------------------------------------------------------------------------
# Only the process that created a file or directory removes it: a forked child (a
# data-loading worker, say) dropping its copies of the tensors leaves them to their creator.
def _remove_file(path: Path, creator: int) -> None:
    if os.getpid() != creator:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a finalizer must not raise; the file is only left behind
        LOGGER.warning("could not remove offloaded payload '%s': %s", path, exc)
    storage.forget_file(path)


_Switch = Callable[[storage.PayloadLayout], None]


def _renamed_over(path: Path, binding: _Binding) -> bool:
    """Whether a write's new file was renamed to ``path``, which held ``binding``'s file
    (or nothing, for a first write of a tensor's own file) before it."""
    try:
        now = file_identity(os.stat(path))
    except OSError:  # (no file there, or no directory: the write failed before its rename)
        return False
    owned = binding.owned
    return owned is None or owned.path != path or now != binding.layout.identity


def _copy_of(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a pool's unsaved ``value`` on ``device``, never an alias of it: an opaque
    value (a ``QTensor``) is rebuilt from copies of its offload state (deep-copied where its
    state refuses a change, which a lease then mends). The kernels that changed a CUDA value
    under a ``read_write`` lease are waited for first."""
    storage.wait_for_writes(value)
    if not isinstance(value, SupportsOffloadState):
        return storage.copy_to(value, device)
    try:
        tensors, metadata = storage.encode_opaque(value)
    except T2NErrorMisuse:
        # A change its offload state refuses (its write-back fails until it is mended, under
        # a read_write lease that shelters a copy first): copied as Python copies objects.
        copied = copy.deepcopy(value)
        return copied if copied.device == device else copied.to(device)
    copies = {name: storage.copy_to(tensor, device) for name, tensor in tensors.items()}
    return storage.decode_opaque(copies, metadata, device)


def _outdated(binding: _Binding, out: Mapping[str, torch.Tensor]) -> bool:
    """Whether the host buffers ``out`` have the entries of ``binding`` with other dtypes or
    shapes: buffers for the payload before a write changed its dtype or shape."""
    wanted = {name: (dtype, shape) for name, dtype, shape in binding.storage_key}
    given = {name: (t.dtype, tuple(t.shape)) for name, t in out.items()}
    return wanted.keys() == given.keys() and wanted != given


class _OwnedFile:
    """A payload file belonging to one tensor: removed when the last reference goes away."""

    __slots__ = ("__weakref__", "_keepalive", "creator", "path", "remove")

    def __init__(self, path: Path, keepalive: object = None) -> None:
        self.path = path
        self.creator = os.getpid()  # a forked child writes files of its own
        self._keepalive = keepalive  # the private directory holding the file, if any
        self.remove = weakref.finalize(self, _remove_file, path, self.creator)
        _remove_at_exit(self)


class _PrivateDir:
    """A temporary directory shared by tensors offloaded without an explicit directory.

    Removed (with anything left in it) when the last tensor holding it is gone, by the
    process that made it (``creator``) only: a forked child writes in one of its own.
    """

    __slots__ = ("__weakref__", "creator", "path", "remove")

    def __init__(self) -> None:
        self.creator = os.getpid()
        with InterruptHold() as hold:  # Ctrl-C is raised once the directory has its remover
            hold.start()
            self.path, lock = storage.make_private_dir()
            self.remove = weakref.finalize(self, _remove_private_dir, self.path, lock, self.creator)
            _remove_at_exit(self)


def _remove_private_dir(path: Path, lock: int, creator: int) -> None:
    if os.getpid() == creator:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):  # the child's copy of the descriptor
        os.close(lock)


_OWNED: weakref.WeakSet[_OwnedFile | _PrivateDir] = weakref.WeakSet()
"""The files and private directories that tensors of this process own, where its exit must
remove them itself (see :func:`_remove_at_exit`)."""
_EXIT_HOOK: list[object] = [0, False]
"""The process that decided whether it must, and its decision."""


def _remove_at_exit(owner: _OwnedFile | _PrivateDir) -> None:
    """Have the exit of this process remove ``owner`` if it is still there. Its finalizer
    runs at an exit through Python's ``atexit``; a ``multiprocessing`` child started by
    ``fork`` or ``forkserver`` (a data-loading worker) leaves with ``os._exit`` once
    multiprocessing's exit functions ran, which skips ``atexit``: in such a child, one of
    those, registered once per process, removes what its tensors own. (Elsewhere, a
    ``spawn`` child included, ``atexit`` alone does, after the pools' exit work: see
    ``residency._runtime``.)"""
    if _EXIT_HOOK[0] != os.getpid():
        _EXIT_HOOK[:] = [os.getpid(), _leaves_without_atexit()]
        if _EXIT_HOOK[1]:
            multiprocessing.util.Finalize(None, _remove_owned, exitpriority=0)
    if _EXIT_HOOK[1]:
        _OWNED.add(owner)


def _leaves_without_atexit() -> bool:
    """Whether this process is a ``multiprocessing`` child that ends with ``os._exit``."""
    if multiprocessing.parent_process() is None:
        return False
    process = multiprocessing.current_process()
    method = getattr(process, "_start_method", None)  # (the class's: ForkProcess, ...)
    if method is None:  # a Process of the default context: its method, inherited or set
        method = multiprocessing.get_start_method(allow_none=True)
    return method in ("fork", "forkserver")


def _remove_owned() -> None:
    """Remove the files and private directories this process's tensors own (at its exit:
    the finalizers run once, whichever exit path runs them first)."""
    for owner in list(_OWNED):
        owner.remove()


_LIVE: weakref.WeakValueDictionary[int, OffloadedTensor] = weakref.WeakValueDictionary()
"""The offloaded tensors of this process, by id."""


def _refuse_if_read(path: Path, name: str) -> None:
    """Refuse to let ``name`` own the file ``path`` while a live tensor reads it (under any
    name: a link): the adopter would remove it under that tensor, or a checkpoint with it.
    Files are compared by their identity (device, inode, size, modification time), as each
    tensor's layout recorded it when read or written (no call to the system per tensor): a
    new file given the inode of a live tensor's file removed from outside is another file."""
    try:
        wanted = file_identity(os.stat(path))
    except OSError:
        return  # reading the layout says what is wrong
    for tensor in list(_LIVE.values()):
        if tensor._binding.layout.identity == wanted:
            raise T2NErrorMisuse(
                f"payload file '{path}' is read by the live OffloadedTensor "
                f"{tensor._name!r}: {name!r} cannot adopt it (an adopted file is removed "
                "with its tensor); use that tensor, or copy.deepcopy() of it for an "
                "independent one"
            )


def _reset_writes_in_child() -> None:
    """After ``fork``, in the child: the writes the parent's threads had under way (a pool's
    write-back, say) do not happen here. Their locks, held by threads the child does not
    have, and their announcements, which reads would wait for forever, are reset; a value a
    pool changed and had not written yet stays the latest value the child reads. A write
    whose switch to its new file had begun at the fork (its file renamed into place) ends
    here: the file holds the tensor's latest value."""
    for tensor in list(_LIVE.values()):
        switching = tensor._switching
        tensor._reset_writes()
        if switching is not None:
            tensor._switch_in_child(*switching)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_writes_in_child)


_PRIVATE_DIR: weakref.ref[_PrivateDir] | None = None
_PRIVATE_DIR_LOCK = fork_safe_lock()


def _private_dir() -> _PrivateDir:
    """The private temporary directory in use, created when none of this process is alive."""
    global _PRIVATE_DIR
    with _PRIVATE_DIR_LOCK:
        current = _PRIVATE_DIR() if _PRIVATE_DIR is not None else None
        if current is None or current.creator != os.getpid():
            current = _PrivateDir()
            _PRIVATE_DIR = weakref.ref(current)
        return current


def _directory(offload_dir: PathLike) -> Path:
    """``offload_dir`` as an absolute path, as it names a directory now: later writes go
    there whatever the working directory is by then. A value of another type is refused by
    name."""
    return path_argument(offload_dir, "offload_dir", "a directory's path", optional=True).absolute()


def _resolve_dir(offload_dir: PathLike | None) -> tuple[Path, _PrivateDir | None]:
    """The directory to write payloads in, created if needed, and the private one it may be."""
    if offload_dir is None:
        private = _private_dir()
        return private.path, private
    directory = _directory(offload_dir)
    if directory.exists() and not directory.is_dir():
        raise T2NErrorStorage(
            f"offload_dir '{directory}' exists and is not a directory; pass a directory"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise T2NErrorStorage(
            f"cannot create the offload directory '{directory}': {exc}; pass a writable offload_dir"
        ) from exc
    return directory, None


# ---------------------------------------------------------------------------------------------
# The binding of a tensor to its payload
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Binding:
    """Where the value of a tensor lives. Replaced as a whole on each write.

    ``names`` maps the logical entry names (``"tensor"`` for a plain value, the offload state
    names for an opaque one) to the entry names in the file (a checkpoint key, for instance).
    Logical names are what :attr:`OffloadedTensor.storage_key` and host buffers use, so that
    buffers can be shared by tensors of different files.
    """

    layout: storage.PayloadLayout
    names: Mapping[str, str]
    opaque: bool
    owned: _OwnedFile | None
    storage_key: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    nbytes: int

    @classmethod
    def create(
        cls,
        layout: storage.PayloadLayout,
        names: Mapping[str, str],
        *,
        opaque: bool,
        owned: _OwnedFile | None,
    ) -> _Binding:
        specs = {logical: layout.entries[entry] for logical, entry in names.items()}
        key = tuple(
            (logical, specs[logical].dtype, specs[logical].shape) for logical in sorted(specs)
        )
        nbytes = sum(spec.nbytes for spec in specs.values())
        return cls(layout, dict(names), opaque, owned, key, nbytes)

    @property
    def file_names(self) -> list[str]:
        """The entries of the file this binding reads."""
        return list(self.names.values())

    def spec(self, logical: str) -> storage.EntrySpec:
        return self.layout.entries[self.names[logical]]

    def by_logical(self, host: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Re-key tensors read from the file by their logical names."""
        return {logical: host[entry] for logical, entry in self.names.items()}

    def by_entry(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Re-key host buffers given by logical names by the entry names of the file."""
        unknown = sorted(name for name in buffers if name not in self.names)
        if unknown:
            raise T2NErrorMisuse(
                f"out holds buffers for {unknown}, which are not entries of this payload "
                f"(entries: {sorted(self.names)}); pass buffers matching storage_key"
            )
        return {self.names[logical]: buffer for logical, buffer in buffers.items()}


def _bind_plain(layout: storage.PayloadLayout, owned: _OwnedFile | None) -> _Binding:
    entries = list(layout.entries)
    if len(entries) != 1:
        raise T2NErrorStorage(
            f"payload file '{layout.path}' holds {len(entries)} entries {entries} and no opaque "
            "class tag; an OffloadedTensor payload holds exactly one plain entry"
        )
    return _Binding.create(layout, {_PLAIN_ENTRY: entries[0]}, opaque=False, owned=owned)


def _bind_file(layout: storage.PayloadLayout, owned: _OwnedFile | None) -> _Binding:
    if storage.is_opaque_payload(layout.metadata):
        names = {name: name for name in layout.entries}
        return _Binding.create(layout, names, opaque=True, owned=owned)
    return _bind_plain(layout, owned)


# ---------------------------------------------------------------------------------------------
# Values: what is written, what is read back
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Encoded:
    """A value ready to be written: its payload tensors and what the shell must report."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    opaque: bool
    value_type: type[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _encode(value: torch.Tensor, what: str = "the value") -> _Encoded:
    """Describe ``value`` as payload tensors (an opaque value by its offload state); ``what``
    names it in errors."""
    if isinstance(value, torch.Tensor):
        refuse_unstorable(value, what)
    shape, dtype = tuple(value.shape), value.dtype
    if isinstance(value, SupportsOffloadState):
        tensors, metadata = storage.encode_opaque(value)
        return _Encoded(dict(tensors), dict(metadata), True, type(value), shape, dtype)
    if isinstance(value, OpaqueTensor):
        raise T2NErrorNotImplemented(
            f"{type(value).__name__} cannot be offloaded: it does not implement "
            "SupportsOffloadState; expand it with opaque_to_final_tensor() first"
        )
    if not isinstance(value, torch.Tensor):
        raise T2NErrorMisuse(f"an OffloadedTensor holds a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise T2NErrorMisuse(
            f"a meta tensor of shape {shape} holds no values to offload; bind meta parameters "
            "to a checkpoint with load_offloaded_checkpoint() or OffloadedTensor.from_safetensors()"
        )
    plain = value.detach()
    if type(plain) is not torch.Tensor:
        plain = plain.as_subclass(torch.Tensor)
    return _Encoded({_PLAIN_ENTRY: plain}, {}, False, torch.Tensor, shape, dtype)


def _materialize(
    binding: _Binding, host: Mapping[str, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The value of a payload read into ``host`` (by entry name), on ``device``.

    Blocking (a CUDA copy is synchronised): call it from a worker thread in async code.
    """
    if binding.opaque:
        value = storage.decode_opaque(
            binding.by_logical(host), binding.layout.metadata, target_device=device
        )
        if value.device != device:
            value = value.to(device)
        return value
    value = host[binding.names[_PLAIN_ENTRY]]  # (read into CPU memory: there already)
    return value if device.type == "cpu" else storage.to_device(value, device)


def _read_to_device(binding: _Binding, device: torch.device) -> torch.Tensor:
    """The value of a payload read straight to the CUDA ``device``, through the device's
    pinned ring; an opaque payload is decoded on the device from its payload tensors. The
    copies may still be queued: the value is pending until ``storage.handoff``."""

    def build(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if binding.opaque:  # built where its tensors are: on the device already
            return storage.decode_opaque(binding.by_logical(tensors), binding.layout.metadata)
        return tensors[binding.names[_PLAIN_ENTRY]]

    return storage.read_to_device(binding.layout, device, build, names=binding.file_names)


def _read_targets(
    binding: _Binding, out: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """The host buffers a read of ``binding`` fills, by entry name (``out``, given by logical
    name); ``None``: fresh ones."""
    return None if out is None else binding.by_entry(out)


def _is_whole_host_buffer(tensor: Any, spec: storage.EntrySpec) -> bool:
    """Whether ``tensor`` is a dense CPU tensor owning exactly the memory of entry ``spec``."""
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, OpaqueTensor)
        and tensor.device.type == "cpu"
        and tensor.dtype == spec.dtype
        and tuple(tensor.shape) == spec.shape
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == spec.nbytes
    )


def _without_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """``torch.Tensor.to``'s arguments without ``copy`` (taken out of ``kwargs``), and it:
    positional, it follows ``non_blocking`` (``to(dtype, non_blocking, copy)``,
    ``to(other, non_blocking, copy)``, ``to(device, dtype, non_blocking, copy)``)."""
    copy = bool(kwargs.pop("copy", False))
    position = 2 if args and isinstance(args[0], (torch.dtype, torch.Tensor)) else 3
    if len(args) > position and isinstance(args[position], bool):
        copy = copy or args[position]
        args = args[:position] + args[position + 1 :]
    return args, copy


def _is_meta(device: DeviceLike) -> bool:
    """Whether ``device`` names the meta device (``False`` for what names no device)."""
    try:
        return torch.device(device).type == "meta"
    except (TypeError, RuntimeError):
        return False


def _canonical_device(device: DeviceLike) -> torch.device:
    """``device`` as :func:`storage.resolve_device` resolves it, which the meta device is not
    (a value there could not be loaded)."""
    target = storage.resolve_device(device)
    if target.type == "meta":
        module = _module_converted()
        stopped = (
            ""
            if module is None
            else f" ({type(module).__name__}.to() stopped here; torch converts a module's "
            "tensors one by one: those kept in memory that it reached before this one are "
            "on the meta device already, their values gone)"
        )
        raise T2NErrorMisuse(
            "an OffloadedTensor cannot target the meta device: its value must be loadable; "
            f"use a real device such as 'cpu' or 'cuda:0'{stopped}"
        )
    return target


def _describe(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} and dtype {dtype}"


# ---------------------------------------------------------------------------------------------
# In-place operations and gc requests, seen from __torch_function__
# ---------------------------------------------------------------------------------------------
def _holds_offloaded(value: Any) -> bool:
    """Whether ``value`` is a list or tuple holding an offloaded tensor."""
    return type(value) in (list, tuple) and any(isinstance(v, OffloadedTensor) for v in value)


def _multi_tensor_refusal(func: Callable[..., Any]) -> T2NErrorNotImplemented:
    return T2NErrorNotImplemented(
        f"{getattr(func, '__name__', func)!r} writes a list of tensors holding offloaded "
        "ones in place (a multi-tensor op): its writes would be lost. Write each "
        "tensor on its own (optimizers: foreach=False, fused=False)"
    )


_ONLY_READS: dict[Any, bool] = {}


def _only_reads(func: Callable[..., Any]) -> bool:
    """Whether ``func``, called with positional arguments alone, takes the last case of
    :meth:`OffloadedTensor.__torch_function__` whatever they are: it writes none of them
    (neither in place, nor as :func:`_arguments_written` finds, nor as a lookup of few rows
    reads its table), and runs on the values of the opaque ones (decided once per function)."""
    try:
        return _ONLY_READS[func]
    except KeyError:
        pass
    except TypeError:  # unhashable callable
        return False
    reads = (
        not _writes_first_argument(func)
        and getattr(func, "overloadpacket", func) not in _RUNNING_STATS_FLAG
        and func not in _LOOKUPS_WITH_MAX_NORM  # (the lookup of few rows among them)
        and _runs_expanded(func)
    )
    return _remember(_ONLY_READS, func, reads)


def _arguments_written(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> list[int | str]:
    """Where the offloaded tensors that an op other than an in-place method writes are
    (argument positions, or keywords): the running mean and variance of a batch norm in
    training mode (its second and third arguments) and of an instance norm using its input's
    statistics (keywords), those of torch's own batch and instance norms updating them
    (:data:`_RUNNING_STATS_FLAG`), the table of an embedding lookup (or bag) with
    ``max_norm`` (which renormalizes the rows it gathers, in the table). Their kernels write
    them in place, without torch's version counter knowing."""
    flag = _RUNNING_STATS_FLAG.get(getattr(func, "overloadpacket", func))
    if func is torch.nn.functional.batch_norm and kwargs.get("training"):
        places: list[int | str] = [1, 2]
    elif func is torch.nn.functional.instance_norm and kwargs.get("use_input_stats"):
        places = ["running_mean", "running_var"]
    elif flag is not None and _argument(args, kwargs, _place(args, 5, flag)):
        places = [_place(args, 3, "running_mean"), _place(args, 4, "running_var")]
    elif (
        func in _LOOKUPS_WITH_MAX_NORM
        and _argument(args, kwargs, _place(args, 3, "max_norm")) is not None
    ):
        places = [_place(args, 1, "weight")]
    else:
        return []
    return [
        place for place in places if isinstance(_argument(args, kwargs, place), OffloadedTensor)
    ]


_LOOKUPS_WITH_MAX_NORM = (torch.nn.functional.embedding, torch.nn.functional.embedding_bag)
"""Lookups whose fourth argument, ``max_norm``, has them renormalize their table's rows."""

_RUNNING_STATS_FLAG: dict[Any, str] = {
    torch.batch_norm: "training",
    torch.native_batch_norm: "training",
    torch.instance_norm: "use_input_stats",
    torch.ops.aten.batch_norm: "training",
    torch.ops.aten.native_batch_norm: "training",
    torch.ops.aten.instance_norm: "use_input_stats",
}
"""Torch's own batch and instance norms (and their aten ops), by the keyword of the flag that
has them update the running mean and variance (their fourth and fifth arguments, the flag the
sixth): their schemas do not mark those as written (``Tensor? running_mean``), and
``instance_norm`` writes them through an alias, so the change is found by name."""


def _argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], place: int | str) -> Any:
    if isinstance(place, int):
        return args[place] if place < len(args) else None
    return kwargs.get(place)


def _place(args: tuple[Any, ...], position: int, keyword: str) -> int | str:
    """Where an argument of a call is: its position when passed by position, else its
    keyword."""
    return position if position < len(args) else keyword


def _apply_writing_arguments(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    written: list[int | str],
) -> Any:
    """Run ``func`` with the offloaded tensors at ``written`` written as an in-place op
    writes each (:meth:`OffloadedTensor._change`, one inside the other). Where the result
    is a written value (or a list or tuple holding some: an aten op returns what it wrote),
    it holds the offloaded tensor instead, never a value a pool serves."""

    def run(values: dict[int | str, torch.Tensor], places: list[int | str]) -> Any:
        if places:
            place, rest = places[0], places[1:]
            tensor: OffloadedTensor = _argument(args, kwargs, place)
            for earlier, value in values.items():  # one tensor in two places: one value
                if _argument(args, kwargs, earlier) is tensor:
                    return run({**values, place: value}, rest)
            return tensor._change(func, lambda value: run({**values, place: value}, rest))
        arguments = [values.get(i, _expand_argument(a)) for i, a in enumerate(args)]
        keywords = {k: values.get(k, _expand_argument(v)) for k, v in kwargs.items()}
        result = func(*arguments, **keywords)
        tensors = {id(value): _argument(args, kwargs, place) for place, value in values.items()}
        if type(result) in (list, tuple):
            return type(result)(tensors.get(id(item), item) for item in result)
        return tensors.get(id(result), result)

    return run({}, written)


_FEW_ROWS = 64
"""A lookup gathering at most 1/64 of a table's rows reads them alone (a page or so each, in
the computing thread); one gathering more reads the table as a load does, in one sequential
read (a long prompt's prefill, on a cold page cache)."""


def _looked_up_table(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> OffloadedTensor | None:
    """The offloaded table of an embedding lookup (``F.embedding``) that gathers few of its
    rows (:data:`_FEW_ROWS`); ``None`` for any other op, for a lookup of many rows, and in a
    trace (``torch.jit.trace``, ``torch.compile``: the expansion is what they record). A
    lookup with ``max_norm`` writes its table: :func:`_arguments_written` takes it first."""
    if func is not torch.nn.functional.embedding or _is_tracing():
        return None
    indices = _argument(args, kwargs, _place(args, 0, "input"))
    table = _argument(args, kwargs, _place(args, 1, "weight"))
    if not isinstance(table, OffloadedTensor):
        return None
    few = isinstance(indices, torch.Tensor) and indices.numel() * _FEW_ROWS <= table.shape[0]
    return table if few else None


def _note_aliases(
    pool: ScopePool, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any
) -> None:
    """Tell ``pool`` (a scope's) the tensors an op returned, for each offloaded argument
    (positional or keyword): a view among them, or the value the pool served itself (an op
    that returns its input: ``t.float()`` of a float tensor, ``t.contiguous()``), may alias
    that value."""
    if isinstance(result, torch.Tensor):
        results: tuple[torch.Tensor, ...] = (result,)
    elif type(result) in (list, tuple):
        results = tuple(item for item in result if isinstance(item, torch.Tensor))
    else:
        return
    sources = [argument for argument in args if isinstance(argument, OffloadedTensor)]
    if kwargs:
        sources += [value for value in kwargs.values() if isinstance(value, OffloadedTensor)]
    if results and sources:
        pool._scope_aliased(sources, results)


def _expand_argument(value: Any) -> Any:
    if isinstance(value, OpaqueTensor):
        return opaque_to_final_tensor(value)
    if type(value) in (list, tuple):
        return type(value)(_expand_argument(item) for item in value)
    return value


class _GcRequest(threading.local):
    """Set when a tensor with ``force_gc_collect`` was loaded during the current operation."""

    pending = False


_GC_REQUEST = _GcRequest()


# ---------------------------------------------------------------------------------------------
# Module conversions that swap parameters
# ---------------------------------------------------------------------------------------------
_MODULE_APPLY = torch.nn.Module._apply.__code__


def _module_converted() -> torch.nn.Module | None:
    """The module whose conversion (``Module._apply``: ``model.to()``, ``model.half()``, ...)
    the calling thread runs, the outermost where one converts its children; ``None`` out of
    any."""
    converted = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _MODULE_APPLY:
            converted = frame.f_locals.get("self")
        frame = frame.f_back
    return converted if isinstance(converted, torch.nn.Module) else None


def _refuse_swapping_conversion() -> None:
    """Refuse the conversion of a module holding offloaded parameters while torch swaps
    converted parameters in (``torch.__future__.set_swap_module_params_on_conversion(True)``),
    from the first operation the conversion makes on an offloaded tensor, which it would
    otherwise have converted in place.

    ``torch.utils.swap_tensors`` refuses a tensor that has weak references, which every
    offloaded tensor has (the registry of live tensors, that of traced ones): torch raised its
    own error there, the tensors it had reached already converted, the model half converted.
    Swapping would also make an offloaded parameter a plain one (``model.half()``), which the
    conversion without the switch keeps offloaded, in place: the same parameter object, which
    is what the switch is for. Tensors kept resident (``offload_module(min_bytes=...)``) that
    the conversion reaches before any offloaded one are converted by torch before the refusal.

    Raises:
        T2NErrorNotImplemented: such a conversion runs on this thread.
    """
    if not torch.__future__.get_swap_module_params_on_conversion():
        return
    module = _module_converted()
    if module is None:
        return
    offloaded = [n for n, p in module.named_parameters() if isinstance(p, OffloadedTensor)]
    if offloaded:
        raise T2NErrorNotImplemented(
            f"{type(module).__name__} holds offloaded parameters ({offloaded[0]!r}, "
            f"{len(offloaded)} in all), which a conversion swapping parameters "
            "(torch.__future__.set_swap_module_params_on_conversion(True)) cannot convert: "
            "torch.utils.swap_tensors refuses tensors with weak references, as offloaded "
            "ones have. No offloaded tensor was converted. Convert with the switch off "
            "(set_swap_module_params_on_conversion(False)): each offloaded parameter is "
            "converted in place and stays the same object"
        )


def _cuda_device(device: object = None, *_: object, **__: object) -> object:
    return f"cuda:{device}" if isinstance(device, int) else device or "cuda"


def _dtype_given(dtype: object = None, *_: object, **__: object) -> object:
    return dtype if isinstance(dtype, torch.dtype) else None  # (a type's name: a copy)


_BUFFER_CONVERSIONS: dict[Callable[..., Any], Callable[..., object]] = {
    torch.Tensor.half: lambda *_, **__: torch.float16,
    torch.Tensor.float: lambda *_, **__: torch.float32,
    torch.Tensor.double: lambda *_, **__: torch.float64,
    torch.Tensor.bfloat16: lambda *_, **__: torch.bfloat16,
    torch.Tensor.cpu: lambda *_, **__: "cpu",
    torch.Tensor.cuda: _cuda_device,
    torch.Tensor.type: _dtype_given,
}
"""The conversions a module applies to its tensors (``model.half()``, ``model.cuda(1)``),
and what each gives ``OffloadedTensor.to``, from the call's other arguments."""


def _converted_buffer(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> OffloadedTensor | None:
    """An offloaded buffer that a module's conversion (``model.half()``, ``model.cpu()``,
    ...) reaches, converted in place as :meth:`OffloadedTensor.to` converts (``None``: not
    such a call). Torch converts a parameter by assigning ``.data``, which keeps it
    offloaded, but replaces a buffer by what the conversion returns: a loaded plain tensor,
    the buffer then in memory for good."""
    target = _BUFFER_CONVERSIONS.get(func)
    if target is None or not args or not isinstance(args[0], OffloadedTensor):
        return None
    tensor = args[0]
    # Only the conversion's own call: the function ``Module._apply`` runs on the buffer
    # called the method (a user's ``buf.half()``, made in a conversion or not, gets a copy).
    caller = sys._getframe(2)  # (above this function and __torch_function__)
    apply = caller.f_back
    if apply is None or apply.f_code is not _MODULE_APPLY:
        return None
    convert, module = apply.f_locals.get("fn"), apply.f_locals.get("self")
    if (
        getattr(convert, "__code__", None) is not caller.f_code
        or not isinstance(module, torch.nn.Module)
        or not any(buffer is tensor for buffer in module._buffers.values())
    ):
        return None
    converted = target(*args[1:], **kwargs)
    return None if converted is None else tensor.to(converted)


def _opaque_offloaded(module: torch.nn.Module) -> OffloadedTensor | None:
    """The first offloaded tensor of ``module`` holding an opaque value, if any."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if isinstance(tensor, OffloadedTensor) and tensor._binding.opaque:
            return tensor
    return None


# ---------------------------------------------------------------------------------------------
# The tensor
# ---------------------------------------------------------------------------------------------
class OffloadedTensor(OpaqueTensor, PoolSource):
    """A tensor whose value lives in a payload file and is loaded on use.

    The shell reports the shape, dtype and target device of the value; ``is_meta`` is false,
    the tensor hashes by identity. Torch operations load the value (see :meth:`reload`),
    compute and return plain tensors; ``nn.Parameter(offloaded, requires_grad=False)`` keeps
    the type, so modules can hold offloaded weights. In-place operations (``mul_``,
    ``copy_``, ``x[i] = v``, ``nn.init.*``) load the value, apply the operation and write the
    result back atomically. A view (``t[0]``, ``t.T``, ``t.view(-1)``) is a view of a loaded
    value, not of the tensor: an in-place operation on it (``t[0].add_(1)``) does not write
    the tensor, nor does ``nn.init.orthogonal_``, which writes through such a view. Write
    through the tensor itself (``t[0] += 1`` writes ``t[0] = t[0] + 1``), or with
    :meth:`update_values`.

    Most code builds one with :meth:`from_original_tensor` or :meth:`from_safetensors`. The
    constructor either writes ``elem`` to a new payload file, or (``elem`` ``None`` or a meta
    tensor) adopts the payload file that ``offload_dir``, ``name`` and ``storage_id`` designate.

    Args:
        elem: the value to offload (a plain tensor, on any device, or an opaque tensor
            implementing ``SupportsOffloadState``); or ``None`` / a meta tensor of the expected
            shape and dtype to adopt an existing payload file.
        device: the target device, where :meth:`reload` delivers the value.
        offload_dir: the directory of the payload file; ``None`` for a private temporary
            directory (only when writing ``elem``).
        name: the tensor's name (its PyTorch path, typically); it names the file.
        offloaded_tensor_type: the type the reloaded value has: ``torch.Tensor`` for a plain
            tensor, the opaque class (e.g. ``QTensorTractScaleOnly``) otherwise.
        force_gc_collect: run ``gc.collect()`` after every torch operation that loaded this
            tensor, to give the loaded value's memory back at once.
        storage_id: the unique part of the file name; a fresh one when ``None`` (required to
            adopt a file).

    Raises:
        T2NErrorMisuse: inconsistent arguments, or a new payload file would replace an
            existing file.
        T2NErrorInconsistentTensor: an adopted file does not hold the shape, dtype or type
            announced.
        T2NErrorStorage: the payload cannot be written, or an adopted file is missing or
            invalid.

    Attributes:
        offload_dir: the directory of the tensor's own payload files (writes and copies on
            write); ``None`` for a tensor pointing into a checkpoint that has not been
            written to and was given no directory.
        storage_id: the unique part of the payload file name.
        offloaded_tensor_type: the type :meth:`reload` returns: ``torch.Tensor``, or the
            opaque class of the value (e.g. ``QTensorTractScaleOnly``).
        force_gc_collect: whether ``gc.collect()`` runs after each torch operation that
            loaded this tensor.
    """

    _name: str
    offload_dir: Path | None
    storage_id: str
    offloaded_tensor_type: type[torch.Tensor]
    force_gc_collect: bool
    _binding: _Binding
    _private: _PrivateDir | None
    _write_lock: threading.RLock
    _hit_state: HitState
    _pending_lock: threading.RLock
    _write_waiters: Waiters
    _pending_writes: int
    _deriving: object | None
    _unsaved: tuple[object, object, torch.Tensor] | None

    @staticmethod
    def __new__(  # type: ignore[misc]
        cls,
        elem: torch.Tensor | None,
        device: DeviceLike,
        offload_dir: PathLike | None,
        name: str,
        offloaded_tensor_type: type[torch.Tensor] = torch.Tensor,
        force_gc_collect: bool = False,
        storage_id: str | None = None,
    ) -> OffloadedTensor:
        if not isinstance(name, str):
            raise T2NErrorMisuse(f"name must be a str, got {type(name).__name__}")
        if storage_id is not None and (not isinstance(storage_id, str) or not storage_id):
            raise T2NErrorMisuse(f"storage_id must be a non-empty str, got {storage_id!r}")
        if elem is not None and not isinstance(elem, torch.Tensor):
            raise T2NErrorMisuse(
                f"elem of {name!r} must be the tensor to offload, or None to adopt an existing "
                f"payload file; got {type(elem).__name__}"
            )
        target = _canonical_device(device)
        if elem is None or (elem.device.type == "meta" and not isinstance(elem, OpaqueTensor)):
            return cls._adopt(
                elem, target, offload_dir, name, offloaded_tensor_type, force_gc_collect, storage_id
            )
        if isinstance(elem, OffloadedTensor):
            elem = elem.reload(_CPU)
        encoded = _encode(elem, f"the value of {name!r}")
        _check_value_type(encoded.value_type, offloaded_tensor_type, name)
        directory, private = _resolve_dir(offload_dir)
        sid = storage_id or _new_storage_id()
        path = storage.payload_path(directory, name, sid)
        if path.exists():
            raise T2NErrorMisuse(
                f"payload file '{path}' already exists: another tensor uses storage_id {sid!r} "
                f"for {name!r}; pass a distinct storage_id (or None for a fresh one)"
            )
        # From the rename to the file's owner, Ctrl-C is held (raised once the owner, which
        # removes the file when dropped, exists): landing in between, it would orphan the file.
        with InterruptHold() as hold:
            layout = storage.write_payload(
                path, encoded.tensors, encoded.metadata, before_replace=hold.start
            )
            owned = _OwnedFile(path, private)
        binding = (
            _Binding.create(layout, {n: n for n in layout.entries}, opaque=True, owned=owned)
            if encoded.opaque
            else _bind_plain(layout, owned)
        )
        return cls._make(
            binding,
            shape=encoded.shape,
            dtype=encoded.dtype,
            device=target,
            name=name,
            offload_dir=directory,
            private=private,
            storage_id=sid,
            value_type=encoded.value_type,
            force_gc_collect=force_gc_collect,
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Everything is set up by __new__ (or _make); nothing left to initialise.
        super().__init__()

    @classmethod
    def _adopt(
        cls,
        elem: torch.Tensor | None,
        device: torch.device,
        offload_dir: PathLike | None,
        name: str,
        offloaded_tensor_type: type[torch.Tensor],
        force_gc_collect: bool,
        storage_id: str | None,
    ) -> OffloadedTensor:
        """Bind a new tensor to the existing payload file it designates, taking ownership."""
        if offload_dir is None or storage_id is None:
            raise T2NErrorMisuse(
                f"to point {name!r} at an existing payload file, give its offload_dir and "
                "storage_id; to offload values, pass them as elem"
            )
        directory = _directory(offload_dir)
        path = storage.payload_path(directory, name, storage_id)
        _refuse_if_read(path, name)
        layout = storage.read_layout(path)
        binding = _bind_file(layout, owned=None)  # owned only once every check passed
        if binding.opaque:
            # The shape and dtype of an opaque value are its own: decode it once to learn them.
            value = storage.decode_opaque(
                binding.by_logical(storage.read_payload(layout)), layout.metadata
            )
            shape, dtype, value_type = tuple(value.shape), value.dtype, type(value)
        else:
            spec = binding.spec(_PLAIN_ENTRY)
            shape, dtype, value_type = spec.shape, spec.dtype, torch.Tensor
        if elem is not None and (tuple(elem.shape), elem.dtype) != (shape, dtype):
            raise T2NErrorInconsistentTensor(
                f"payload file '{path}' holds {_describe(shape, dtype)}, but {name!r} was "
                f"announced with {_describe(elem.shape, elem.dtype)}"
            )
        _check_value_type(value_type, offloaded_tensor_type, name, error=T2NErrorInconsistentTensor)
        return cls._make(
            dataclasses.replace(binding, owned=_OwnedFile(path)),
            shape=shape,
            dtype=dtype,
            device=device,
            name=name,
            offload_dir=directory,
            private=None,
            storage_id=storage_id,
            value_type=value_type,
            force_gc_collect=force_gc_collect,
        )

    @classmethod
    def _make(
        cls,
        binding: _Binding,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        name: str,
        offload_dir: Path | None,
        private: _PrivateDir | None,
        storage_id: str,
        value_type: type[torch.Tensor],
        force_gc_collect: bool,
    ) -> OffloadedTensor:
        """Build the shell and attach its state (no I/O)."""
        self: OffloadedTensor = OpaqueTensor._make_shell(cls, shape, dtype, device)
        self._name = name
        self.offload_dir = offload_dir
        self.storage_id = storage_id
        self.offloaded_tensor_type = value_type
        self.force_gc_collect = bool(force_gc_collect)
        self._binding = binding
        self._private = private
        self._hit_state = HitState(device)  # the target device and the latest write
        self._unsaved = None
        self._reset_writes()
        _LIVE[id(self)] = self
        return self

    def _reset_writes(self) -> None:
        """No write under way: free locks, no write-back announced."""
        self._write_lock = owned_lock()
        self._pending_lock = owned_lock()
        self._write_waiters = Waiters()  # copies waiting for the announced writes' end
        self._pending_writes = 0
        # The latest write a direct read-modify-write (_rewrite) derived the value it is
        # writing from, while it writes it: a pool's change on that write is older than it.
        self._deriving = None
        # From the start to the end of a write's switch to its new file: that file's layout
        # and the switch, which a child forked meanwhile runs again (_switch_in_child).
        self._switching: tuple[storage.PayloadLayout, _Switch] | None = None

    def _switch_in_child(self, layout: storage.PayloadLayout, switch: _Switch) -> None:
        """In a forked child, run again the switch that the fork cut (it may run twice):
        its file was renamed into place before the fork, and is the tensor's latest value
        unless the parent's threads replaced it since, which its reads then report."""
        try:
            now = file_identity(os.stat(layout.path))
        except OSError:
            return
        if layout.identity is not None and now == layout.identity:
            switch(layout)
            self._switching = None  # (the switch marks itself begun; no thread ends it here)

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def from_original_tensor(
        cls,
        tensor: torch.Tensor,
        name: str,
        offload_dir: PathLike | None = None,
        suffix_log_msg: str = "",
    ) -> OffloadedTensor:
        """Write ``tensor`` to a new payload file and return the tensor standing for it.

        Args:
            tensor: a plain tensor (on any device), or an opaque tensor implementing
                ``SupportsOffloadState`` (an offloaded ``QTensor`` reloads as a ``QTensor``).
                An ``OffloadedTensor`` is returned unchanged.
            name: the tensor's name; it names the file.
            offload_dir: where to write; ``None`` for a private temporary directory removed
                once no tensor uses it anymore.
            suffix_log_msg: appended to the info log line announcing the offload.

        Returns:
            an OffloadedTensor targeting ``tensor``'s device, owning its new file.

        Raises:
            T2NErrorMisuse: ``tensor`` is a meta tensor (nothing to write).
            T2NErrorNotImplemented: ``tensor`` is an opaque tensor without offload state.
            T2NErrorStorage: the file cannot be written.
        """
        if isinstance(tensor, OffloadedTensor):
            return tensor
        if not isinstance(tensor, torch.Tensor):
            raise T2NErrorMisuse(
                f"from_original_tensor needs a tensor, got {type(tensor).__name__}"
            )
        if tensor.device.type == "meta":
            raise T2NErrorMisuse(
                f"cannot offload {name!r}: it is a meta tensor and holds no values; bind it to "
                "a checkpoint with OffloadedTensor.from_safetensors() instead"
            )
        value_type = type(tensor) if isinstance(tensor, SupportsOffloadState) else torch.Tensor
        offloaded: OffloadedTensor = cls(tensor, tensor.device, offload_dir, name, value_type)
        LOGGER.info(
            "offloaded %r (%s, %d bytes) to '%s'%s",
            name,
            _describe(offloaded.shape, offloaded.dtype),
            offloaded.payload_nbytes,
            offloaded.offload_path,
            suffix_log_msg,
        )
        return offloaded

    @classmethod
    def from_safetensors(
        cls,
        path: PathLike | storage.PayloadLayout,
        key: str,
        *,
        offload_dir: PathLike | None = None,
        device: DeviceLike = "cpu",
        name: str | None = None,
    ) -> OffloadedTensor:
        """Point at the tensor ``key`` of an existing ``.safetensors`` file, without copying.

        The file's header is validated; the tensor reads the entry's bytes in place. The
        checkpoint is never modified nor removed: the first write (:meth:`update_values`,
        ``to(dtype)``, an in-place operation) copies the new value into a payload file of
        ``offload_dir`` that the tensor owns.

        Args:
            path: the ``.safetensors`` file, or its layout already read with
                ``storage.read_layout`` (to bind many keys of one file with one header read).
            key: the tensor's key in the file.
            offload_dir: where a copy on write goes; ``None`` for a private temporary directory.
            device: the target device.
            name: the tensor's name; ``key`` by default.

        Raises:
            T2NErrorStorage: the file is missing or invalid.
            T2NErrorCheckpoint: the file has no tensor ``key``.
        """
        layout = path if isinstance(path, storage.PayloadLayout) else storage.read_layout(path)
        spec = layout.entries.get(key)
        if spec is None:
            available = sorted(layout.entries)
            shown = ", ".join(repr(k) for k in available[:8])
            more = f", ... ({len(available)} in all)" if len(available) > 8 else ""
            raise T2NErrorCheckpoint(
                f"checkpoint '{layout.path}' has no tensor {key!r}; it holds {shown}{more}"
            )
        binding = _Binding.create(layout, {_PLAIN_ENTRY: key}, opaque=False, owned=None)
        return cls._make(
            binding,
            shape=spec.shape,
            dtype=spec.dtype,
            device=_canonical_device(device),
            name=key if name is None else name,
            offload_dir=None if offload_dir is None else _directory(offload_dir),
            private=None,
            storage_id=_new_storage_id(),
            value_type=torch.Tensor,
            force_gc_collect=False,
        )

    # -- what the tensor stands for ----------------------------------------------------------
    @property  # type: ignore[override]
    def name(self) -> str:  # type: ignore[override]
        """The tensor's name (its PyTorch path, typically), as given at creation."""
        return self._name

    @property  # type: ignore[override]
    def device(self) -> torch.device:  # type: ignore[override]
        """The target device (answered from Python: no torch dispatch on this hot path)."""
        return self._hit_state.device

    @property
    def target_device(self) -> torch.device:
        """The device :meth:`reload` delivers the value to (the tensor's ``device``)."""
        return self._hit_state.device

    @property
    def elem(self) -> torch.Tensor:
        """A tensor on the meta device with this tensor's shape and dtype, holding no value
        (upstream torch-to-nnef's shell)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    @property
    def offload_path(self) -> Path:
        """The file the value is read from (a checkpoint, for a tensor pointing into one)."""
        return self._binding.layout.path

    @property
    def owns_payload(self) -> bool:
        """Whether the payload file belongs to this tensor (removed with it)."""
        return self._binding.owned is not None

    @property
    def payload_nbytes(self) -> int:
        """Bytes the loaded host value occupies: the sum of the payload entries it reads."""
        return self._binding.nbytes

    @property
    def payload_version(self) -> object:
        """An object replaced by every write of the payload file (compare by identity)."""
        return self._binding

    @property
    def storage_key(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        """Signature of the payload's host buffers: ``((entry, dtype, shape), ...)``.

        Two tensors with equal keys can load into each other's host buffers (see
        :meth:`_host_buffers` and the ``out`` argument of :meth:`_reload_unmanaged`); entries
        are named by their logical names (``"tensor"`` for a plain value), not by file keys.
        """
        return self._binding.storage_key

    def __len__(self) -> int:
        if self.dim() == 0:
            raise TypeError("len() of a 0-d tensor")
        return int(self.shape[0])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        binding = self._binding
        where = f"path='{binding.layout.path}'"
        if binding.owned is None:
            where += f", key={binding.names[_PLAIN_ENTRY]!r}"
        kind = ""
        if self.offloaded_tensor_type is not torch.Tensor:
            kind = f", offloaded_tensor_type={self.offloaded_tensor_type.__name__}"
        return (
            f"OffloadedTensor(name={self._name!r}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device}, {where}{kind})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedTensor:
        """An independent offloaded copy (``copy.deepcopy`` of a model keeps it offloaded).

        A tensor pointing into a checkpoint is copied as another pointer into it, unless a
        pool holds an unsaved change of it; otherwise the copy gets a new payload file of the
        latest value in the same directory (a private directory stays private). Parameter
        status, target device, name and options are kept.
        """
        existing = memo.get(id(self))
        if isinstance(existing, OffloadedTensor):
            return existing
        duplicate: OffloadedTensor
        binding = self._checkpoint_binding()
        if binding is not None:
            duplicate = type(self).from_safetensors(
                binding.layout,
                binding.names[_PLAIN_ENTRY],
                offload_dir=self.offload_dir,
                device=self.device,
                name=self._name,
            )
            duplicate.force_gc_collect = self.force_gc_collect
        else:
            duplicate = type(self)(
                self._reload_unmanaged(_CPU),
                self.device,
                None if self._private is not None else self.offload_dir,
                self._name,
                self.offloaded_tensor_type,
                self.force_gc_collect,
            )
        if self.__dict__.get("_is_param"):
            duplicate._is_param = True  # what nn.Parameter(duplicate, requires_grad=False) sets
        memo[id(self)] = duplicate
        return duplicate

    def _checkpoint_binding(self) -> _Binding | None:
        """The binding into a checkpoint that holds the latest value, or ``None`` (the
        tensor owns its file, or a pool holds an unsaved change of it).

        Read after the announced write-backs end, and together with the unsaved value under
        the lock a write-back's switch takes: a write-back moves the tensor to its own file
        and drops the unsaved value in one step, so the two never disagree."""
        self._wait_announced_writes()
        with self._pending_lock:
            binding = self._binding
            if binding.owned is None and self._unsaved is None:
                return binding
            return None

    def __copy__(self) -> OffloadedTensor:
        """A copy, as :meth:`__deepcopy__` makes: two tensors never share a payload they own."""
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as its value: what :meth:`reload` returns, read when pickled (a plain
        tensor, or a quantized value pickled as its ``QTensor``).

        ``torch.save(model.state_dict(), path)`` writes a whole checkpoint of the values
        (``torch.load`` gives them back as such), holding every value in memory until it
        ends, as ``torch.save`` does; a refusal in the middle would leave ``path`` torn. To
        keep values on disk, bind the checkpoint again instead (``load_offloaded_checkpoint``).
        A parameter (``nn.Parameter(t, requires_grad=False)``) comes back as a parameter.
        """
        value = self.reload()
        _keep_for_spawned_child(value)
        if self.__dict__.get("_is_param"):
            return (torch._utils._rebuild_parameter, (value, False, collections.OrderedDict()))
        return value.__reduce_ex__(protocol)

    def _no_memory(self, what: str) -> T2NErrorNotImplemented:
        """Why ``what`` is refused (see :meth:`OpaqueTensor.data_ptr`), with how to save a
        model of offloaded tensors."""
        return T2NErrorNotImplemented(
            f"OffloadedTensor {self._name!r} has no memory of its own for {what}: its value "
            f"lives in '{self.offload_path}', and each load makes a new one. Use the value "
            "(t.reload()); to save a model, give it its values, e.g. `model.save_pretrained("
            "path, state_dict={k: v.reload() if isinstance(v, OffloadedTensor) else v for k, "
            "v in model.state_dict().items()})`"
        )

    # -- loading -----------------------------------------------------------------------------
    def reload(self, device: DeviceLike | None = None) -> torch.Tensor:
        """Return the value, on the target device or on ``device``.

        ``device`` does not change the configured target. Inside a residency scope
        (``pool.scope()``), the active pool serves the value (``device`` or, when ``None``, the
        scope's device); otherwise the value is read from the file. An opaque payload reloads
        as its opaque type (a ``QTensor``), not decompressed.

        ``device="meta"`` gives a meta tensor of the value's shape and dtype, reading nothing.

        Raises:
            T2NErrorStorage: the file is missing, corrupt, or changed by another process.
        """
        if device is not None and _is_meta(device):
            return self.elem
        wanted = None if device is None else _canonical_device(device)
        scope = active_tensor_residency()
        if scope is not None:
            pool, scope_device = scope
            return pool._scope_resolve(self, wanted if wanted is not None else scope_device)
        count_load_outside_scopes()
        return storage.handoff(self._reload_unmanaged(wanted))

    def _rows_value(self) -> torch.Tensor | None:
        """The value for an op that reads a few of its rows (an embedding lookup), where that
        costs less than a load: a CPU value of a mapped payload is mapped without reading
        anything, and the op's reads fault in the pages of the rows it gathers (one token's
        row of a 131 MB table is a few KiB). Inside a residency scope, a value that the pool
        holds, or is loading, is taken from the pool, and nothing else goes into it.

        Returns ``None`` where the value is loaded as usual (:meth:`reload`): an opaque or
        small payload, a device other than the CPU, mapped reads switched off.
        """
        scope = active_tensor_residency()
        device = self.device if scope is None or scope[1] is None else scope[1]
        if not self._reads_rows_on_demand(device):
            return None
        if self.force_gc_collect:
            _GC_REQUEST.pending = True  # as for any use of the value (``_to_base_tensor``)
        if scope is not None:
            held = scope[0]._scope_held(self, device)
            if held is not None:
                return held
        else:
            count_load_outside_scopes()
        return self._reload_unmanaged(device, on_demand=True)

    def write_qtensor_in_file(
        self, dirpath: PathLike, label: str, inference_target: Any = None
    ) -> bool:
        """Write the inference engine's file of an offloaded opaque value, straight from disk.

        The payload's offload state is read and handed to its class's
        ``write_offload_state_in_file`` (a ``QTensorTractScaleOnly`` writes a tract ``.dat``
        file), without rebuilding the value. A value changed inside a residency pool is what
        the file holds once the pool has written it back (``pool.flush(t)``).

        Args:
            dirpath: the model folder.
            label: the tensor's label in the engine's graph.
            inference_target: passed to ``write_offload_state_in_file``.

        Returns:
            ``True`` when a file was written; ``False`` for a plain (not opaque) payload,
            which has no engine-specific file.

        Raises:
            T2NErrorStorage: the payload file is missing or corrupt.
            T2NErrorNotImplemented: the value's class has no engine file format.
        """
        with self._write_lock:  # no write replaces the payload while it is read
            binding = self._binding
            if not binding.opaque:
                return False
            host = storage.read_payload(binding.layout, names=binding.file_names)
        cls, state = storage.decode_offload_state(binding.by_logical(host), binding.layout.metadata)
        cls.write_offload_state_in_file(state, dirpath, label, inference_target=inference_target)
        return True

    def _to_base_tensor(self) -> torch.Tensor:
        if self.force_gc_collect:
            _GC_REQUEST.pending = True
        return self.reload()

    def _reads_rows_on_demand(self, device: torch.device) -> bool:
        """Whether :meth:`_rows_value` maps the value for ``device`` (see there)."""
        return device.type == "cpu" and self._mappable() and storage.mapped_reads()

    def _mappable(self) -> bool:
        """Whether a CPU load maps the payload, mapped reads on (``storage.load_payload``):
        a plain payload large enough."""
        return not self._binding.opaque and self.payload_nbytes >= storage.MAPPED_MIN_BYTES

    def _reload_unmanaged(
        self,
        device: DeviceLike | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
        mapped: bool | None = None,
        on_demand: bool = False,
    ) -> torch.Tensor:
        """Read the value from the file and bring it to ``device`` (blocking; no pool).

        For a CUDA device the file is read straight to the device and the value is returned
        once its copies are queued: hand it to its consumer with ``storage.handoff``.

        Args:
            device: where the value is delivered (default: the target device).
            out: host buffers to read into, by logical entry name (as in :attr:`storage_key`);
                when ``None``, a plain value for the CPU maps the file (see
                ``storage.set_mapped_reads``), other values get new buffers.
            mapped: whether a plain value for the CPU without ``out`` maps the file (``False``:
                it is read into new host buffers, which a pool may reuse); ``None``: as
                ``storage.set_mapped_reads`` says.
            on_demand: a mapping reads no page before the value is read, then only the pages
                read (``storage.load_payload``).

        The value is read outside any ``torch.func`` transform the caller runs (``grad``,
        ``jvp``, ``vjp``): buffers made inside one would be its wrappers, which hold no
        memory to read into; the value is a constant of the transform, as a loaded weight is.
        """
        with torch._C._DisableFuncTorch():
            return self._read_value(device, out, mapped, on_demand)

    def _read_value(
        self,
        device: DeviceLike | None,
        out: Mapping[str, torch.Tensor] | None,
        mapped: bool | None,
        on_demand: bool,
    ) -> torch.Tensor:
        """:meth:`_reload_unmanaged`, inside the transforms the caller runs."""
        target = self.device if device is None else _canonical_device(device)
        # A pool's unsaved change is the latest write whether its write-back is announced or
        # not: a copy of it is read without waiting for that write-back, which may be queued
        # behind the very load (of another pool's worker) that reads it here. Without one,
        # the file is the latest write: an announced write-back writes nothing but the unsaved
        # change (it was committed, in the step that ended it, or a later write replaced it),
        # so none is waited for either (it too may be queued behind a load of another pool).
        unsaved = self._unsaved_copy(target)
        if unsaved is not None:
            return unsaved
        attempt = 0
        while True:
            binding = self._binding
            if out is not None and _outdated(binding, out):
                out = None  # read into new buffers
            try:
                if target.type == "cuda" and out is None:
                    return _read_to_device(binding, target)
                targets = _read_targets(binding, out)
                host = storage.load_payload(  # plain CPU values: mapped, unless switched off
                    binding.layout,
                    out=targets,
                    names=binding.file_names,
                    mapped=mapped if targets is None and not binding.opaque else False,
                    on_demand=on_demand,
                )
            except T2NErrorStorage as error:
                attempt += 1
                if attempt < _READ_ATTEMPTS and self._replaced_since(binding):
                    continue
                gone = isinstance(error.__cause__, (FileNotFoundError, NotADirectoryError))
                if not gone and not storage.changed_since_read(binding.layout):
                    raise
                raise self._changed_under(binding, gone) from error
            return _materialize(binding, host, target)

    def _changed_under(self, binding: _Binding, gone: bool) -> T2NErrorStorage:
        """The error of a read of ``binding``'s file that something other than this tensor
        replaced, rewrote or deleted (``gone``): who can have, and what to do."""
        owned = binding.owned
        if owned is None:
            cause = (
                "the checkpoint file it is bound to is gone (deleted or moved since it was "
                "bound); bind the model to the checkpoint where it is now"
                if gone
                else "the checkpoint file it is bound to changed since it was bound; bind the "
                "model to the checkpoint again (a bound checkpoint must not be rewritten "
                "while its tensors live)"
            )
        elif owned.creator != os.getpid():
            cause = (
                "the process this one was forked from wrote or freed it after the fork, "
                "replacing or removing its file; in the child, take copies (copy.deepcopy) of "
                "the tensors it needs before the parent writes or frees them"
            )
        elif gone:
            cause = (
                "its payload file was deleted by something other than this package, and its "
                "value with it (an offload directory must be left alone while its tensors live)"
            )
        else:
            cause = "another process replaced its payload file"
        return T2NErrorStorage(
            f"offloaded tensor {self._name!r} cannot be read: {cause} "
            f"(file '{binding.layout.path}')"
        )

    def _wait_announced_writes(self) -> None:
        """Wait until the write-backs announced by residency pools have ended (a wait that
        Ctrl-C cuts cleanly: see :mod:`torch_to_nnef._waiting`)."""
        if self._pending_writes:
            self._write_waiters.wait(self._pending_lock, lambda: not self._pending_writes)

    def _unsaved_copy(self, device: torch.device) -> torch.Tensor | None:
        """A copy on ``device`` of the value a pool changed and has not written yet, when it
        is the latest write; ``None`` otherwise.

        Copied under the lock that :meth:`_shelter_unsaved` takes to swap the value for its
        copy: a ``read_write`` lease entering on the value waits for this copy to end before
        it changes anything, so the copy never holds part of its change.
        """
        if self._unsaved is None:  # the usual case, read without the lock
            return None
        with self._pending_lock:
            unsaved = self._unsaved
            return None if unsaved is None else _copy_of(unsaved[2], device)

    def _note_unsaved(
        self, owner: object, value: torch.Tensor, version: object, alone: Callable[[], bool]
    ) -> bool | None:
        """The pool ``owner`` changed its value, read at ``version`` as it sees it (a
        ``read_write`` lease ends): the change becomes the latest write of the tensor, unless
        another write came since (the later write stands; returns ``False``). Reads outside
        that pool, other pools included, see it; an older unsaved value of another pool is
        superseded (its write-back will not happen).

        ``alone()``, asked under the lock that :meth:`_shelter_unsaved` takes, says that no
        other lease of ``owner`` entered on ``value`` since the caller decided to note: when
        one did, it may be changing the value already, and nothing is noted (``None``)."""
        state = self._hit_state
        with self._pending_lock:
            if not alone():
                return None
            if state.version_for(owner) is not version or self._deriving is state.latest[0]:
                return False  # (or a direct write derived from the older value is under way)
            # The unsaved value first, then the token: a read looks at the token, then at
            # the unsaved value without this lock (_reload_unmanaged), so one that finds the
            # new token finds the value it stands for (a read that finds the value and the
            # old token is taken as older than it is: read again, never kept as current).
            token = object()
            self._unsaved = (owner, token, value)
            state.count_write(owner, token)
            return True

    def _shelter_unsaved(self, owner: object, value: torch.Tensor) -> None:
        """A ``read_write`` lease of the pool ``owner`` is entered on ``value``: when that is
        the tensor's latest write (a change of an earlier lease, not written yet), reads
        outside the pool go on seeing it as it was, a copy, and never the change under way,
        which becomes the latest write only when the lease ends (``_note_unsaved``).

        Looked at and copied under the lock the note takes (never without it, even to find
        no unsaved value): a note under way when the lease was entered either saw it entered
        (and noted nothing) or ends before this look."""
        with self._pending_lock:
            unsaved = self._unsaved
            if unsaved is None or unsaved[0] is not owner or unsaved[2] is not value:
                return
            self._unsaved = (owner, unsaved[1], _copy_of(value, value.device))

    def _announce_write(self) -> None:
        """A pool chose to write this tensor's value back: copies of the
        tensor (copy.deepcopy) wait for it from now on."""
        with self._pending_lock:
            self._pending_writes += 1

    def _write_back(self, value: torch.Tensor, owner: object) -> object | None:
        """Write a pool's announced value (blocking) unless a later write superseded it.

        Returns the version of the value written as ``owner`` sees it, or ``None`` when the
        value was superseded (a direct write, or another pool's change, came after it in
        program order). The announcement ends whatever happens. The kernels that changed a
        CUDA value under a ``read_write`` lease are waited for first.
        """
        try:
            storage.wait_for_writes(value)
            with self._write_lock:
                with self._pending_lock:  # the value's version: a later change is not in it
                    unsaved, version = self._unsaved, self._hit_state.version_for(owner)
                if unsaved is None or unsaved[0] is not owner:
                    return None
                self._write_encoded(self._check_update(value, True, True), None, keep=unsaved[1])
                return version
        finally:
            self._end_write()

    def _map_written(self, version: object, owner: object) -> torch.Tensor | None:
        """The CPU value mapping the file, while it holds the pool ``owner``'s write-back of
        ``version`` and nothing came since (no other write, no unsaved change of the pool's),
        for a payload a CPU load maps; ``None`` otherwise, or when the file cannot be mapped."""
        if not self._mappable():
            return None
        with self._write_lock:
            with self._pending_lock:
                if self._unsaved is not None or self._hit_state.version_for(owner) is not version:
                    return None
            binding = self._binding
            try:
                host = storage.load_payload(binding.layout, names=binding.file_names, mapped=True)
            except T2NErrorStorage:
                return None
        return _materialize(binding, host, torch.device("cpu"))

    def _write_unsaved(self, owner: object) -> None:
        """Write the pool ``owner``'s unsaved value, when it is the latest write (blocking).

        For a pool that cannot wait for the end of a ``read_write`` lease on the value (at
        interpreter exit): what it writes is the change of leases that ended, sheltered
        from the one under way (see :meth:`_shelter_unsaved`), copied under the lock that
        a lease entering on it takes before it changes anything.
        """
        with self._write_lock:
            with self._pending_lock:
                unsaved = self._unsaved
                if unsaved is None or unsaved[0] is not owner:
                    return
                value = _copy_of(unsaved[2], unsaved[2].device)
            self._write_encoded(self._check_update(value, True, True), None, keep=unsaved[1])

    def _end_write(self) -> None:
        """End an announced write-back: copies waiting for it go on."""
        with self._pending_lock:
            self._pending_writes -= 1
            if not self._pending_writes:
                self._write_waiters.release()

    def _replaced_since(self, binding: _Binding) -> bool:
        """Whether a write replaced ``binding`` (after any write in progress has committed).

        A reader that fails because the file was replaced under it retries with the new
        binding instead of reporting a corrupt file.
        """
        with self._write_lock:
            return self._binding is not binding

    def _host_buffers(self, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The host buffers backing ``value``, a value loaded from this tensor's payload.

        For a plain payload loaded on the CPU, the value is its own host buffer: it is
        returned as ``{"tensor": value}`` when it is a whole, dense CPU tensor of the
        payload's dtype and shape. ``None`` otherwise: a value on another device (a copy of
        the host buffer), or an opaque value, whose decoding may keep views of the read
        buffers or transform them, so that no buffer can be safely handed out. The caller
        asks only for a value read into host buffers (``out``, or ``mapped=False``: a mapped
        value's pages are the file's), and may reuse them for another load (see
        :meth:`_reload_unmanaged`) once nothing else references them.
        """
        binding = self._binding
        if binding.opaque or not _is_whole_host_buffer(value, binding.spec(_PLAIN_ENTRY)):
            return None
        return {_PLAIN_ENTRY: value}

    # -- writing -----------------------------------------------------------------------------
    def update_values(
        self, values: torch.Tensor, strict_shape: bool = True, strict_dtype: bool = True
    ) -> None:
        """Replace the payload by ``values``, atomically.

        The file is replaced with a temporary file, fsync and rename: a crash at any moment
        leaves the old or the new values. A tensor pointing into a checkpoint copies on write
        into its offload directory. ``values`` may live on any device; an opaque value with an
        offload state (a ``QTensor``) is stored as such; another ``OffloadedTensor`` is
        copied. The target device is kept.

        Args:
            values: the new value.
            strict_shape: refuse a shape different from the current one.
            strict_dtype: refuse a dtype different from the current one.

        Raises:
            T2NErrorValueMismatch: the shape or dtype differs under a strict check (the message
                gives both); a ``T2NErrorMisuse`` and an ``AssertionError``.
            T2NErrorMisuse: ``values`` is not a storable tensor.
            T2NErrorStorage: the file cannot be written (the old payload stays).
        """
        self._replace_value(values, strict_shape, strict_dtype, device=None)

    def _replace_value(
        self,
        values: torch.Tensor,
        strict_shape: bool,
        strict_dtype: bool,
        device: torch.device | None,
    ) -> None:
        """Write ``values`` as the payload and, if ``device`` is given, retarget to it."""
        self._refuse_a_write_in_a_transform()
        if values is self:
            return
        if isinstance(values, OffloadedTensor):
            values = values.reload(_CPU)
        self._write_locked(self._check_update(values, strict_shape, strict_dtype), device)

    def _check_update(
        self, values: torch.Tensor, strict_shape: bool, strict_dtype: bool
    ) -> _Encoded:
        if not isinstance(values, torch.Tensor):
            raise T2NErrorMisuse(
                f"update_values of {self._name!r} needs a torch.Tensor, got {type(values).__name__}"
            )
        refuse_unstorable(values, f"the value of {self._name!r}")
        if strict_shape and tuple(values.shape) != tuple(self.shape):
            raise T2NErrorValueMismatch(
                f"update_values of {self._name!r}: new shape {tuple(values.shape)} differs from "
                f"the offloaded shape {tuple(self.shape)}; pass strict_shape=False to change it"
            )
        if strict_dtype and values.dtype != self.dtype:
            raise T2NErrorValueMismatch(
                f"update_values of {self._name!r}: new dtype {values.dtype} differs from the "
                f"offloaded dtype {self.dtype}; pass strict_dtype=False to change it"
            )
        return _encode(values)

    def _write_locked(self, encoded: _Encoded, device: torch.device | None = None) -> None:
        """Write ``encoded`` to the tensor's own file and switch to it (blocking).

        The shell takes the new shape and dtype (and ``device`` when given) in the same step.
        A value a pool changed and has not written yet is superseded: this write is later.
        """
        self._refuse_a_write_amid_its_own()
        with self._write_lock:
            self._write_encoded(encoded, device, keep=None)

    def _refuse_a_write_amid_its_own(self) -> None:
        """A direct write made amid the tensor's own write or bookkeeping on this thread (by
        a finalizer that a garbage collection ran there) would be lost under the one it
        interrupts, or reorder it: refused."""
        if held_here(self._pending_lock) or held_here(self._write_lock):
            raise T2NErrorMisuse(
                f"{self._name!r} was written by code run amid its own write on this thread "
                "(a finalizer a garbage collection ran there, say): one of the two writes "
                "would be lost; write it outside finalizers"
            )

    def _refuse_a_write_in_a_transform(self) -> None:
        """A write inside a ``torch.func`` transform (``grad``, ``vmap``, ...) would mutate a
        tensor the transform captured, as torch refuses for any tensor; what it would write
        is the transform's wrapper, which has no memory to write from: refused."""
        if torch._C._functorch.maybe_current_level() is not None:
            raise T2NErrorMisuse(
                f"{self._name!r} was written inside a torch.func transform (grad, vjp, jvp, "
                "vmap, ...): a transform's function must not change the tensors it captures; "
                "write it outside the transform (with a value computed inside it, returned)"
            )

    def _write_encoded(
        self, encoded: _Encoded, device: torch.device | None, keep: object | None
    ) -> None:
        """The write itself, under the write lock. Ends the unsaved value registered with
        token ``keep`` (the one written), or any unsaved value when ``keep`` is ``None``.

        The tensor switches to the new file right after the rename, before the directory
        entry is forced to disk (a failure to force it is raised after the switch); from the
        rename to the end of the switch, Ctrl-C is held (raised once the switch is done): a
        tensor never points at a replaced file. An interrupt that no hold holds off (an
        asynchronous exception raised in another thread) landing there finds the rename done
        and the switch not: the switch is finished before it propagates."""
        binding = self._binding
        if binding.owned is not None and binding.owned.creator == os.getpid():
            path, owned = binding.owned.path, binding.owned
        else:
            path, owned = self._copy_on_write_path()

        switched = False

        def switch(layout: storage.PayloadLayout) -> None:
            nonlocal switched
            self._switching = (layout, switch)  # first: its file is in place (see fork)
            storage.forget_file(path)  # the descriptor of the file it replaced
            with self._pending_lock:
                self._binding = (
                    _Binding.create(
                        layout, {n: n for n in layout.entries}, opaque=True, owned=owned
                    )
                    if encoded.opaque
                    else _bind_plain(layout, owned)
                )
                if keep is None:  # a direct write
                    self._hit_state.count_write(None)
                    self._unsaved = None
                elif self._unsaved is not None and self._unsaved[1] is keep:
                    self._unsaved = None
            self.offloaded_tensor_type = encoded.value_type
            self._reshell(encoded.shape, encoded.dtype, device or self.device)
            switched = True

        try:
            with InterruptHold() as hold:
                storage.write_payload(
                    path,
                    encoded.tensors,
                    encoded.metadata,
                    before_replace=hold.start,
                    after_replace=switch,
                )
        except BaseException:
            if not switched and _renamed_over(path, binding):
                switch(storage.read_layout(path))  # (again from the start: it is idempotent)
            raise
        finally:
            self._switching = None
        LOGGER.debug("updated the values of offloaded tensor %r in '%s'", self._name, path)

    def _copy_on_write_path(self) -> tuple[Path, _OwnedFile]:
        """A new owned file for a tensor that read its value from a checkpoint, or from a
        file of the process it was forked from (the parent's tensor goes on reading that
        file: the child's file gets a storage id of its own)."""
        owned = self._binding.owned
        if owned is not None and owned.creator != os.getpid():
            self.storage_id = _new_storage_id()
        # A private directory's tensor writes in the private directory of this process: that
        # of the process it was forked from goes with that process's tensors.
        directory, private = _resolve_dir(None if self._private is not None else self.offload_dir)
        path = storage.payload_path(directory, self._name, self.storage_id)
        if path.exists():
            raise T2NErrorMisuse(
                f"copy on write of {self._name!r} would replace the existing file '{path}'; "
                "give the tensor its own offload_dir or storage_id"
            )
        self.offload_dir = directory
        self._private = private
        return path, _OwnedFile(path, private)

    def _reshell(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """Make the shell report ``shape``, ``dtype`` and ``device``, keeping its identity.

        The tensor keeps its Python identity, attributes and parameter status (modules,
        residency pools and tied weights keep referring to it); only the storage-less
        implementation underneath is swapped for one with the new metadata.
        """
        if (tuple(self.shape), self.dtype, self.device) == (tuple(shape), dtype, device):
            return
        replacement = OpaqueTensor._make_shell(type(self), shape, dtype, device)
        torch._C._swap_tensor_impl(self, replacement)
        self._hit_state.device = device

    # -- torch.Tensor methods with offload semantics -----------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> OffloadedTensor:  # type: ignore[override]
        """Retarget and/or cast the offloaded value, in place; return ``self``.

        Takes the arguments of ``torch.Tensor.to``. A device changes the target device (no
        data moves: the next load goes there). A dtype different from the current one loads
        the value, casts it and rewrites the payload (an opaque value must stay opaque: a
        ``QTensor`` changes the dtype it dequantizes to). Both can be given in one call.

        The tensor is modified in place rather than copied, so that modules, tied weights and
        residency pools holding it follow: ``model.to("cuda")`` and ``model.to(torch.float16)``
        work on offloaded models. (``model.half()``/``model.cuda()`` also work: on a parameter
        by assigning ``.data``, at the price of a load and a write per tensor, except on an
        opaque value, which they would decompress: refused, see :attr:`data`; on a buffer,
        which torch would replace by a loaded copy, in place as here. Out of a module's
        conversion, ``t.half()`` returns a loaded copy, as on any tensor.)

        With ``copy=True`` the tensor is left as it is: an independent offloaded copy (as
        ``copy.deepcopy`` makes) is retargeted and/or cast, and returned.

        Under torch's switch ``torch.__future__.set_swap_module_params_on_conversion(True)``,
        the conversion of a module holding offloaded parameters is refused before any
        offloaded tensor changes: torch would swap each parameter object for a converted one,
        which it cannot do with an offloaded tensor.

        Raises:
            T2NErrorMisuse: the arguments are not those of ``torch.Tensor.to``.
            T2NErrorNotImplemented: a memory format other than the preserved one, a cast
                that turns an opaque value into a plain tensor, or the conversion of a module
                holding offloaded parameters with torch's swap of parameters on.
        """
        _refuse_swapping_conversion()
        args, copy = _without_copy(args, kwargs)
        if copy:
            return self.__deepcopy__({}).to(*args, **kwargs)
        try:
            device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError) as exc:
            raise T2NErrorMisuse(
                f"OffloadedTensor.to() takes the arguments of torch.Tensor.to: {exc}"
            ) from exc
        if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
            raise T2NErrorNotImplemented(
                f"OffloadedTensor payloads are stored contiguous; memory_format={memory_format} "
                "is not supported"
            )
        if dtype is not None and dtype != self.dtype:
            self._cast_payload(dtype)
        if device is not None:
            target = _canonical_device(device)
            with self._write_lock:
                self._reshell(tuple(self.shape), self.dtype, target)
        return self

    def _cast_payload(self, dtype: torch.dtype) -> None:
        storage.dtype_code(dtype)  # a dtype no payload file stores is refused before a read

        def cast() -> tuple[torch.Tensor, None]:
            value = self._reload_unmanaged(_CPU)
            cast = value.to(dtype)
            if isinstance(value, OpaqueTensor) and not isinstance(cast, SupportsOffloadState):
                raise T2NErrorNotImplemented(
                    f"casting offloaded {type(value).__name__} {self._name!r} to {dtype} would "
                    "decompress it; store the plain value explicitly with "
                    f"update_values(opaque_to_final_tensor(ot.reload()).to({dtype}), "
                    "strict_dtype=False)"
                )
            return cast, None

        self._rewrite(cast, strict_dtype=False)
        LOGGER.info("offloaded tensor %r cast to %s", self._name, dtype)

    def _rewrite(
        self, compute: Callable[[], tuple[torch.Tensor, _R]], strict_dtype: bool = True
    ) -> _R:
        """Write the value ``compute`` derives from the tensor's latest write (a direct
        read-modify-write: an in-place op outside any scope, a cast), as one write.

        A write landing while ``compute`` runs (another thread's direct write, a pool's
        change noted as its ``read_write`` lease ends) would be lost if the value derived
        from the write before it were written over it: ``compute`` then runs again, from
        the new latest write. Once the value is found current, it is the later write: a
        ``read_write`` lease ending while the file is written has its change dropped, with
        a warning (:meth:`_note_unsaved`), as when it ends after the write. Returns what
        ``compute`` returned with the value written.
        """
        self._refuse_a_write_in_a_transform()
        self._refuse_a_write_amid_its_own()
        while True:
            with self._pending_lock:
                version = self._hit_state.latest[0]
            value, result = compute()
            try:
                encoded = self._check_update(value, True, strict_dtype)
            except T2NErrorValueMismatch:
                if self._hit_state.latest[0] is not version:  # retyped meanwhile: derive it again
                    continue
                raise
            with self._write_lock:
                try:  # whatever interrupts it, no mark of a write under way is left behind
                    with self._pending_lock:
                        if self._hit_state.latest[0] is not version:
                            continue
                        self._deriving = version
                    self._write_encoded(encoded, None, None)
                finally:
                    self._deriving = None
                return result

    @property  # type: ignore[override]
    def data(self) -> OffloadedTensor:
        """The tensor itself (its special attributes stay reachable).

        Assigning ``.data`` replaces the value as torch does: shape, dtype and device may
        change (the new device becomes the target). It writes the new payload through
        :meth:`update_values`. An opaque payload (a ``QTensor``) takes an opaque value only:
        a plain tensor (what ``model.half()`` or ``model.cuda()`` assign) would decompress it
        without a word, and is refused with ``T2NErrorNotImplemented`` (in such a conversion,
        at the first offloaded tensor of the module it reaches: none is converted);
        ``model.to(dtype)`` and ``model.to(device)`` keep it opaque.
        """
        return self

    @data.setter
    def data(self, new_data: torch.Tensor) -> None:
        if new_data is self:
            return
        if not isinstance(new_data, torch.Tensor):
            raise T2NErrorMisuse(f"data must be a torch.Tensor, got {type(new_data).__name__}")
        if isinstance(new_data, OffloadedTensor):
            opaque = new_data._binding.opaque
        else:
            opaque = isinstance(new_data, SupportsOffloadState)
        if not opaque:
            # A module's conversion assigns every tensor alike: one of its opaque tensors,
            # which refuses the assignment, refuses it before any tensor was converted.
            module = None if self._binding.opaque else _module_converted()
            refused = self if module is None else _opaque_offloaded(module)
            if refused is not None and refused._binding.opaque:
                raise refused._decompressing_assignment(converted=module is not None)
        device = _canonical_device(new_data.device)
        self._replace_value(new_data, strict_shape=False, strict_dtype=False, device=device)

    def _decompressing_assignment(self, converted: bool) -> T2NErrorNotImplemented:
        """The refusal of a plain value assigned to ``.data`` of this opaque tensor, in a
        module's conversion (``converted``) or not."""
        kind = self.offloaded_tensor_type.__name__
        before = " No offloaded tensor was converted." if converted else ""
        return T2NErrorNotImplemented(
            f"assigning a plain tensor to .data of offloaded {kind} {self._name!r} would "
            "decompress it (model.half(), model.cuda() and model.float() assign .data)."
            f"{before} Use model.to(dtype) or model.to(device), which keep it {kind}; to "
            "store a plain value, update_values(value, strict_shape=False, strict_dtype=False)"
        )

    def share_memory_(self) -> OffloadedTensor:  # type: ignore[override]
        """Return ``self``: the value lives in its payload file, which any process reads;
        nothing is loaded or written (``model.share_memory()`` leaves an offloaded model as
        it is)."""
        return self

    def set_(self, source: torch.Tensor, *args: Any, **kwargs: Any) -> OffloadedTensor:  # type: ignore[override]
        """Replace the value by ``source``: its values, shape and dtype (a quantizer may give
        a weight a new dtype in place). Routes to :meth:`update_values` without strict
        checks; the target device is kept.

        Raises:
            T2NErrorMisuse: ``source`` is not a tensor, or a storage, offset, size or stride
                is given.
        """
        if args or kwargs or not isinstance(source, torch.Tensor):
            raise T2NErrorMisuse(
                "OffloadedTensor.set_() only takes a source tensor (no storage, offset, size "
                "or stride): it stores a copy of the source's values"
            )
        self.update_values(source, strict_shape=False, strict_dtype=False)
        return self

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> OffloadedTensor:  # type: ignore[override]
        """Write ``src`` (broadcast and cast to this tensor's shape and dtype) as the value.

        Unlike other in-place operations, the current value is not loaded first.

        Args:
            src: the values to copy (any device; an opaque tensor is expanded first).
            non_blocking: accepted for compatibility with ``torch.Tensor.copy_``; the write
                always completes before the call returns.

        Raises:
            T2NErrorNotImplemented: the payload is opaque (a ``QTensor``): write a new value
                with :meth:`update_values` instead.
            T2NErrorStorage: the new payload cannot be written (the old one stays).
        """
        if self._binding.opaque:
            self._refuse_in_place("copy_")
        source = _expand_argument(src)

        def copy() -> tuple[torch.Tensor, None]:
            value = torch.empty(tuple(self.shape), dtype=self.dtype)
            with torch._C.DisableTorchFunctionSubclass():
                value.copy_(source)
            return value, None

        self._rewrite(copy)  # the shape and dtype of the latest write, whatever retypes it
        return self

    def _refuse_in_place(self, operation: str) -> None:
        raise T2NErrorNotImplemented(
            f"in-place {operation} on offloaded {self.offloaded_tensor_type.__name__} "
            f"{self._name!r} would decompress it; write a new value with update_values()"
        )

    def _apply_in_place(
        self, func: Callable[..., Any], rest: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        """Run the in-place ``func`` on the loaded value and write the result back."""
        arguments = _expand_argument(rest)
        keywords = {key: _expand_argument(item) for key, item in kwargs.items()}
        return self._change(func, lambda value: func(value, *arguments, **keywords))

    def _apply_to_keyword(
        self,
        name: str,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """Run ``func`` with this tensor as its keyword argument ``name``, which it writes
        (``out=``; ``tensor=`` of the ``nn.init`` functions)."""
        arguments = _expand_argument(args)
        keywords = {key: _expand_argument(item) for key, item in kwargs.items() if key != name}
        return self._change(func, lambda value: func(*arguments, **{name: value}, **keywords))

    def _change(self, func: Callable[..., Any], run: Callable[[torch.Tensor], Any]) -> Any:
        """Change the loaded value with ``run`` (an op writing it) and write the result back.

        Inside a residency scope the value is changed under a ``read_write`` lease of the
        active pool, which writes it back (on eviction, flush or close); elsewhere the payload
        is rewritten at once.
        """
        if self._binding.opaque:
            self._refuse_in_place(getattr(func, "__name__", repr(func)))
        if torch._C._get_tracing_state() is not None:
            raise T2NErrorNotImplemented(
                f"{getattr(func, '__name__', func)!r} writes the offloaded tensor "
                f"{self._name!r} under torch.jit.trace: a trace replays no write to a file; "
                "change the tensor before or after tracing"
            )
        # The value records no autograd history (offloaded tensors have no gradients): a
        # pool's value changed by an input requiring them would hold that graph.
        scope = active_tensor_residency()
        if scope is not None:
            self._refuse_a_write_in_a_transform()  # (elsewhere _rewrite refuses it)
            pool, device = scope
            lease = pool._scope_lease(self, device)
            with lease as value, torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                result = run(value)
            return self if result is value else result

        def change() -> tuple[torch.Tensor, Any]:
            value = storage.handoff(self._reload_unmanaged())
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                result = run(value)
            return value, self if result is value else result

        return self._rewrite(change)

    @classmethod
    def _write_at_dispatch(
        cls,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        places: list[int | str],
    ) -> Any:
        """Run the aten op ``func``, which writes the tensors at ``places``, as their
        in-place ops write them (:meth:`_change`: under a pool's ``read_write`` lease in a
        scope, rewriting the payload elsewhere); ``set_`` as :meth:`set_` does, storing a copy
        of the source. An op reaches this without ``__torch_function__`` when called through
        ``torch.ops.aten``, or through a binding of torch that skips it
        (``torch.Tensor.set_``).

        Raises:
            T2NErrorNotImplemented: a written argument is a list of tensors (a multi-tensor
                op), another opaque tensor, or an offloaded opaque value (a ``QTensor``).
        """
        written = [_argument(args, kwargs, place) for place in places]
        for tensor in written:
            if type(tensor) in (list, tuple):
                raise _multi_tensor_refusal(func)
            if not isinstance(tensor, OffloadedTensor):
                return type(tensor)._write_at_dispatch(func, args, kwargs, places)
        if getattr(func, "overloadpacket", None) is torch.ops.aten.set_:
            source = args[1] if len(args) > 1 else None
            return written[0].set_(source, *args[2:], **kwargs)
        return _apply_writing_arguments(func, args, kwargs, places)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        _refuse_swapping_conversion()
        if func in _BUFFER_CONVERSIONS:
            buffer = _converted_buffer(func, args, kwargs)
            if buffer is not None:
                return buffer
        read = not kwargs and _only_reads(func)  # most ops: none of the cases below applies
        writes = not read and (_writes_first_argument(func) or kwargs.get("inplace") is True)
        if read:
            result = _call_on_values(func, args)
        elif args and isinstance(args[0], OffloadedTensor) and writes:
            result = args[0]._apply_in_place(func, args[1:], kwargs)
        elif isinstance(kwargs.get("out"), OffloadedTensor):
            result = kwargs["out"]._apply_to_keyword("out", func, args, kwargs)
        elif not args and writes and isinstance(kwargs.get("tensor"), OffloadedTensor):
            result = kwargs["tensor"]._apply_to_keyword("tensor", func, args, kwargs)
        elif writes and args and _holds_offloaded(args[0]):
            raise _multi_tensor_refusal(func)
        elif written := _arguments_written(func, args, kwargs):
            result = _apply_writing_arguments(func, args, kwargs, written)
        elif (table := _looked_up_table(func, args, kwargs)) is not None and (
            rows := table._rows_value()
        ) is not None:
            args = tuple(rows if argument is table else argument for argument in args)
            kwargs = {key: rows if value is table else value for key, value in kwargs.items()}
            result = super().__torch_function__(func, types, args, kwargs)
        else:
            result = super().__torch_function__(func, types, args, kwargs)
            read = True
        if read:
            scope = active_tensor_residency()
            if scope is not None:
                _note_aliases(scope[0], args, kwargs, result)
        if _GC_REQUEST.pending:
            _GC_REQUEST.pending = False
            gc.collect()
        return result


def _keep_for_spawned_child(value: torch.Tensor) -> None:
    """Keep ``value`` alive while a process is started with it (``spawn``, ``forkserver``:
    ``Process(args=(t,))``). Torch pickles a CPU value for a child process as a shared
    memory descriptor, which the starting process hands to the child by number once
    pickling has ended: the value, made for this pickle, would by then be freed and its
    descriptor closed. It is kept with the starting process's ``Popen`` object, as the
    arguments of ``Process`` are kept with it."""
    popen = multiprocessing.context.get_spawning_popen()
    if popen is not None:
        popen.__dict__.setdefault("_t2n_pickled_values", []).append(value)


def _new_storage_id() -> str:
    return uuid.uuid4().hex[:16]


def _check_value_type(
    value_type: type[torch.Tensor],
    announced: type[torch.Tensor],
    name: str,
    error: type[Exception] = T2NErrorMisuse,
) -> None:
    """Check that ``offloaded_tensor_type`` agrees with the value (a plain or an opaque one)."""
    if not isinstance(announced, type) or not issubclass(announced, torch.Tensor):
        raise T2NErrorMisuse(
            f"offloaded_tensor_type of {name!r} must be a torch.Tensor subclass, got {announced!r}"
        )
    if value_type is torch.Tensor:
        consistent = not issubclass(announced, OpaqueTensor)
    else:
        consistent = issubclass(value_type, announced)
    if not consistent:
        raise error(
            f"{name!r} holds a {value_type.__name__} value but offloaded_tensor_type is "
            f"{announced.__name__}; pass the type of the value"
        )
