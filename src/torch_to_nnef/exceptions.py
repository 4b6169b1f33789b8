"""Errors raised by torch_to_nnef.

Every error a user sees is a :class:`T2NError`; its message says what was wrong and what to do.
Each class also derives from the builtin exception that code written for upstream
torch-to-nnef expects, so that ``except ValueError:`` or ``except NotImplementedError:`` keeps
catching what it caught there::

    T2NError                              base of every error of the library
    ├── T2NErrorMisuse                    (ValueError) the API was called in a way it does not
    │   │                                 support
    │   └── T2NErrorValueMismatch         (AssertionError too) a new value's shape or dtype
    │                                     differs from the tensor's under a strict check
    ├── T2NErrorInconsistentTensor        (ValueError) a replacement tensor disagrees on device,
    │                                     dtype or shape
    ├── T2NErrorNotImplemented            (NotImplementedError) a feature or an operation is not
    │                                     available
    ├── T2NErrorImpossibleQuantization    (NotImplementedError) a tensor cannot be quantized with
    │                                     the requested scheme
    ├── T2NErrorStorage                   (OSError) a payload file is missing, corrupt or
    │                                     unwritable
    ├── T2NErrorCheckpoint                (ValueError) a checkpoint does not match the model it is
    │                                     bound to
    ├── T2NErrorResource                  (RuntimeError) the system refused what the library
    │                                     needs to run (a thread)
    └── T2NErrorTorchGraphExtraction      a traced graph cannot be related to the model
        └── T2NErrorTorchJitTraceFailed   (RuntimeError) a trace refers to an opaque tensor the
                                          model does not hold
"""

from __future__ import annotations

__all__ = [
    "T2NError",
    "T2NErrorCheckpoint",
    "T2NErrorImpossibleQuantization",
    "T2NErrorInconsistentTensor",
    "T2NErrorMisuse",
    "T2NErrorNotImplemented",
    "T2NErrorResource",
    "T2NErrorStorage",
    "T2NErrorTorchGraphExtraction",
    "T2NErrorTorchJitTraceFailed",
    "T2NErrorValueMismatch",
]


class T2NError(Exception):
    """Base class of every error raised by torch_to_nnef."""


class T2NErrorMisuse(ValueError, T2NError):
    """The API was called with arguments or in a state it does not support.

    The message names the offending value and the correct call.
    """


class T2NErrorValueMismatch(T2NErrorMisuse, AssertionError):
    """A new value's shape or dtype differs from the tensor's under a strict check
    (``update_values(values, strict_shape=True, strict_dtype=True)``).

    Also an ``AssertionError``, which upstream torch-to-nnef's check raises.
    """


class T2NErrorNotImplemented(NotImplementedError, T2NError):
    """The requested operation is not available for this tensor type or configuration."""


class T2NErrorImpossibleQuantization(NotImplementedError, T2NError):
    """A tensor cannot be quantized with the requested scheme (its shape is named)."""


class T2NErrorInconsistentTensor(ValueError, T2NError):
    """A replacement tensor disagrees with the one it replaces (device, dtype or shape)."""


class T2NErrorStorage(OSError, T2NError):
    """A payload file is missing, unreadable, corrupt or could not be written.

    The message names the path and the rule that was broken; no partial payload is ever
    returned and nothing on disk is left torn. It is an ``OSError``, like the errors of the
    file operations it stands for.
    """


class T2NErrorCheckpoint(ValueError, T2NError):
    """A checkpoint does not fit its model (missing, unexpected or mis-shaped keys)."""


class T2NErrorResource(RuntimeError, T2NError):
    """The system refused what the library needs to run: a thread for a pool's event loop or
    for its first I/O worker (a limit on the process's threads, say)."""


class T2NErrorTorchGraphExtraction(T2NError):
    """A traced graph cannot be related to the model it was traced from."""


class T2NErrorTorchJitTraceFailed(RuntimeError, T2NErrorTorchGraphExtraction):
    """A trace refers to an opaque tensor that the traced model does not hold."""
