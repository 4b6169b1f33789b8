"""The on-disk format of offloaded tensors: safe, fast, pickle-free payload files.

A payload file uses the safetensors layout (``u64`` header length, JSON header, raw
little-endian data) with the data section aligned to :data:`DATA_ALIGNMENT` bytes, so that
``safetensors.safe_open`` reads it and this package reads any ``.safetensors`` file.

- :func:`read_layout` validates a file's header against its size before anything is allocated.
- :func:`read_payload` / :func:`aread_payload` read entries straight into tensor buffers
  (fresh ones, or the caller's with ``out=``); :func:`allocate` makes such buffers, pinned for
  CUDA targets, and :func:`copy_to` copies a tensor into a fresh one; :func:`to_device`
  copies a host buffer to a device on a dedicated stream; :func:`read_to_device` reads a file
  straight to a CUDA device through a bounded ring of pinned chunks (:func:`pinned_bytes`).
- :func:`map_payload` maps entries as CPU tensors without a copy (page cache pages, private
  copy on write); :func:`advise_payload` starts the kernel's readahead of entries;
  :func:`load_payload` maps entries of :data:`MAPPED_MIN_BYTES` or more and reads smaller
  ones, as :func:`set_mapped_reads` chose.
- :func:`open_regular_file` opens any other file read from disk (a checkpoint's index, a
  shard's first bytes) under the same rules: a regular file, opened without blocking.
- The CUDA rules of values handed to consumers: :func:`resolve_device` (``"cuda"`` resolved
  in the calling thread), :func:`handoff` (safe on the consumer's current stream),
  :func:`record_writes` / :func:`wait_for_writes` (a write-back waits for the kernels that
  changed a value).
- :func:`write_payload` / :func:`awrite_payload` write files atomically; whoever replaces or
  removes a payload file calls :func:`forget_file`, which closes the descriptor mapped loads
  kept for it (it would hold the old file's disk space).
- :func:`encode_opaque` / :func:`decode_opaque` store opaque tensors (``SupportsOffloadState``)
  as the tensors of their offload state plus JSON metadata naming their class tag;
  :func:`decode_offload_state` gives the state itself, without rebuilding the value.
- :func:`payload_path` turns a tensor name into a file name that stays inside its directory;
  :func:`make_private_dir` makes a temporary directory for payloads, and removes those of
  killed processes (as the first write in a directory removes their temporary files).

Every problem with a file raises :class:`~torch_to_nnef.exceptions.T2NErrorStorage` naming the
path and the rule broken; nothing on these paths unpickles.
"""

from __future__ import annotations

from torch_to_nnef.tensor.storage._aio import aread_payload as aread_payload
from torch_to_nnef.tensor.storage._aio import awrite_payload as awrite_payload
from torch_to_nnef.tensor.storage._buffers import allocate as allocate
from torch_to_nnef.tensor.storage._buffers import copy_to as copy_to
from torch_to_nnef.tensor.storage._descriptors import forget as forget_file
from torch_to_nnef.tensor.storage._device import handoff as handoff
from torch_to_nnef.tensor.storage._device import placement_refused as placement_refused
from torch_to_nnef.tensor.storage._device import record_writes as record_writes
from torch_to_nnef.tensor.storage._device import resolve_device as resolve_device
from torch_to_nnef.tensor.storage._device import to_device as to_device
from torch_to_nnef.tensor.storage._device import wait_for_writes as wait_for_writes
from torch_to_nnef.tensor.storage._format import DATA_ALIGNMENT as DATA_ALIGNMENT
from torch_to_nnef.tensor.storage._format import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from torch_to_nnef.tensor.storage._format import EntrySpec as EntrySpec
from torch_to_nnef.tensor.storage._format import PayloadLayout as PayloadLayout
from torch_to_nnef.tensor.storage._format import dtype_code as dtype_code
from torch_to_nnef.tensor.storage._io import changed_since_read as changed_since_read
from torch_to_nnef.tensor.storage._io import make_private_dir as make_private_dir
from torch_to_nnef.tensor.storage._io import open_regular_file as open_regular_file
from torch_to_nnef.tensor.storage._io import read_layout as read_layout
from torch_to_nnef.tensor.storage._io import read_payload as read_payload
from torch_to_nnef.tensor.storage._io import read_to_device as read_to_device
from torch_to_nnef.tensor.storage._io import write_payload as write_payload
from torch_to_nnef.tensor.storage._mapped import MAPPED_MIN_BYTES as MAPPED_MIN_BYTES
from torch_to_nnef.tensor.storage._mapped import advise_payload as advise_payload
from torch_to_nnef.tensor.storage._mapped import load_payload as load_payload
from torch_to_nnef.tensor.storage._mapped import map_payload as map_payload
from torch_to_nnef.tensor.storage._mapped import mapped_reads as mapped_reads
from torch_to_nnef.tensor.storage._mapped import set_mapped_reads as set_mapped_reads
from torch_to_nnef.tensor.storage._opaque import decode_offload_state as decode_offload_state
from torch_to_nnef.tensor.storage._opaque import decode_opaque as decode_opaque
from torch_to_nnef.tensor.storage._opaque import encode_opaque as encode_opaque
from torch_to_nnef.tensor.storage._opaque import is_opaque_payload as is_opaque_payload
from torch_to_nnef.tensor.storage._opaque import value_nbytes as value_nbytes
from torch_to_nnef.tensor.storage._paths import payload_path as payload_path
from torch_to_nnef.tensor.storage._pinned import CHUNK_BYTES as PINNED_CHUNK_BYTES
from torch_to_nnef.tensor.storage._pinned import CHUNKS_PER_DEVICE as PINNED_CHUNKS_PER_DEVICE
from torch_to_nnef.tensor.storage._pinned import pinned_bytes as pinned_bytes

__all__ = [
    # format
    "DATA_ALIGNMENT",
    "MAX_HEADER_BYTES",
    "EntrySpec",
    "PayloadLayout",
    "dtype_code",
    # reading
    "read_layout",
    "changed_since_read",
    "read_payload",
    "aread_payload",
    "map_payload",
    "advise_payload",
    "load_payload",
    "mapped_reads",
    "set_mapped_reads",
    "MAPPED_MIN_BYTES",
    "allocate",
    "copy_to",
    "open_regular_file",
    # devices
    "resolve_device",
    "placement_refused",
    "to_device",
    "read_to_device",
    "handoff",
    "record_writes",
    "wait_for_writes",
    "pinned_bytes",
    "PINNED_CHUNK_BYTES",
    "PINNED_CHUNKS_PER_DEVICE",
    # writing
    "write_payload",
    "forget_file",
    "awrite_payload",
    # opaque payloads
    "encode_opaque",
    "decode_opaque",
    "decode_offload_state",
    "value_nbytes",
    "is_opaque_payload",
    # file names
    "payload_path",
    "make_private_dir",
]
