"""Errors raised by torch_to_nnef.

Every error a user sees is a :class:`T2NError`; its message says what was wrong and what to do.

::

    T2NError                              base of every error of the library
    ├── T2NErrorMisuse                    the API was called in a way it does not support
    ├── T2NErrorNotImplemented            a feature or an operation is not available
    ├── T2NErrorImpossibleQuantization    a tensor cannot be quantized with the requested scheme
    ├── T2NErrorInconsistentTensor        a replacement tensor disagrees on device, dtype or shape
    ├── T2NErrorStorage                   a payload file is missing, corrupt or unwritable
    └── T2NErrorCheckpoint                a checkpoint does not match the model it is bound to
"""

from __future__ import annotations

__all__ = [
    "T2NError",
    "T2NErrorCheckpoint",
    "T2NErrorImpossibleQuantization",
    "T2NErrorInconsistentTensor",
    "T2NErrorMisuse",
    "T2NErrorNotImplemented",
    "T2NErrorStorage",
]


class T2NError(Exception):
    """Base class of every error raised by torch_to_nnef."""


class T2NErrorMisuse(T2NError):
    """The API was called with arguments or in a state it does not support.

    The message names the offending value and the correct call.
    """


class T2NErrorNotImplemented(T2NError, NotImplementedError):
    """The requested operation is not available for this tensor type or configuration."""


class T2NErrorImpossibleQuantization(T2NError):
    """A tensor cannot be quantized with the requested scheme (its shape is named)."""


class T2NErrorInconsistentTensor(T2NError):
    """A replacement tensor disagrees with the one it replaces (device, dtype or shape)."""


class T2NErrorStorage(T2NError):
    """A payload file is missing, unreadable, corrupt or could not be written.

    The message names the path and the rule that was broken; no partial payload is ever
    returned and nothing on disk is left torn.
    """


class T2NErrorCheckpoint(T2NError):
    """A checkpoint does not fit its model (missing, unexpected or mis-shaped keys)."""
