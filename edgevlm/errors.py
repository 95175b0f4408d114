"""One small error hierarchy; the CLI turns each into a one-line message and an exit code, the
server into an HTTP status (its table, ``serve.api_errors.TABLE``, the one place that says which).

Everything a user can reach — the CLI, the chat session, the library's public calls — raises an
``EdgeVLMError`` subclass for a problem it knows about; nothing else is meant to escape.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "ClusterError",
    "ContextExceeded",
    "DoesNotFit",
    "DownloadError",
    "EdgeVLMError",
    "ImageError",
    "InputError",
    "IntegrityError",
    "LibraryError",
    "MemoryBusy",
    "ModelFileError",
    "ModelPairError",
    "OutputError",
    "SavedStateError",
    "SchemaError",
    "UnsupportedModel",
]  # (the error classes; ``shown`` and ``clipped`` below are what their messages quote through)

SHOWN_MAX = 60  # characters of a caller's value an error message repeats (``shown``)
MESSAGE_MAX = 600  # characters of an error message a server answers or logs (``clipped``)


def shown(value: object, most: int = SHOWN_MAX) -> str:
    """A caller's value as an error message quotes it: its ``repr``, or its first ``most``
    characters and how long it was — a 30 MB field is never repeated whole in an error body, a
    log line or a stream."""
    if isinstance(value, str) and len(value) > most:
        return f"{value[:most]!r}… ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= most else f"{text[:most]}… ({len(text):,} characters)"


def clipped(message: str, most: int = MESSAGE_MAX) -> str:
    """``message`` cut to ``most`` characters (saying so): the last guard before an error body or
    a log line, whatever a message was built from."""
    return message if len(message) <= most else f"{message[:most]}… ({len(message):,} characters in all)"


class EdgeVLMError(Exception):
    """Base class of every error edgevlm raises on purpose.

    ``exit_code`` is what the CLI exits with (2 = bad input, 1 = runtime failure); ``code`` a
    machine-readable reason an API puts in its error body (``context_length_exceeded``), carried
    here rather than read out of the message. What a server answers is its error table's
    (``serve.api_errors``).
    """

    exit_code = 1
    code: str | None = None


class InputError(EdgeVLMError):
    """The user gave something unusable (a path, a value, a combination of options)."""

    exit_code = 2


class ContextExceeded(InputError):
    """A request that does not fit the context (its prompt, pictures and reply)."""

    code = "context_length_exceeded"


class SchemaError(InputError):
    """A JSON Schema (or its ``pattern``) that cannot become a grammar, or whose grammar would
    be over edgevlm's limits (``runtime.gbnf.GrammarLimits``). ``path`` names the field that
    says so (``response_format.json_schema.schema.properties.a.maxLength``; "" for the whole)."""

    code = "invalid_json_schema"

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path


class ModelFileError(InputError):
    """A GGUF file is missing, unreadable, truncated, or not the kind of file expected."""


class ModelPairError(InputError):
    """A text model and a vision projector that cannot work together."""


class UnsupportedModel(InputError):
    """A model or projector type edgevlm cannot (yet) count or run."""


class ImageError(InputError):
    """An image that is missing, unreadable or not an image."""

    code = "invalid_image"


class MediaRefused(InputError):
    """A picture's or clip's source the fetch rules refuse: a URL that is private, too slow, too
    large or unreachable, a bad ``data:`` URI, a path outside the allowed folders. ``param``:
    the request's field it came in (a server's error body names it)."""

    code = "invalid_image_url"

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


class MediaTimedOut(EdgeVLMError):
    """A request's own deadline ended while its pictures were fetched (a server: 503)."""

    code = "timeout"


class MemoryBusy(InputError):
    """Not enough memory free right now for this request (another program has it); a server
    answers 503: it may work later."""

    code = "memory_busy"


class BackendError(EdgeVLMError):
    """llama.cpp / mtmd refused or failed at run time."""


class LibraryError(BackendError):
    """llama.cpp's shared libraries did not load (a CUDA wheel without its runtime, a wrong
    architecture, a broken build): nothing that needs llama.cpp can run until the installation
    is fixed, so it exits 2 like bad input; the message names the library, the reason and the fix."""

    exit_code = 2


class DoesNotFit(EdgeVLMError):
    """The plan found no configuration that fits the memory available; says by how much (a
    server answers 507)."""


class SavedStateError(InputError):
    """A saved conversation that cannot be used here: not one, truncated, corrupted, from a
    newer edgevlm, or made with another model, projector, context, KV type or image budget
    (exit 2; a server answers 400). The message names the file and the reason."""

    code = "invalid_saved_conversation"


class OutputError(EdgeVLMError):
    """A result file could not be written (disk full, permissions): the run stops (exit 1)."""


class DownloadError(EdgeVLMError):
    """The hub could not be reached, refused, or sent something else than announced (exit 1; a
    server answers 502)."""


class IntegrityError(DownloadError):
    """A downloaded file does not have the hub's sha256."""


class ClusterError(EdgeVLMError):
    """A Ray cluster could not be reached, or its actors failed the whole run."""
