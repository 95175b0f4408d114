"""One small error hierarchy; the CLI turns each into a one-line message and an exit code."""

from __future__ import annotations


class EdgeVLMError(Exception):
    """Base class of every error edgevlm raises on purpose.

    ``exit_code`` is what the CLI exits with (2 = bad input, 1 = runtime failure).
    """

    exit_code = 1


class InputError(EdgeVLMError):
    """The user gave something unusable (a path, a value, a combination of options)."""

    exit_code = 2


class ModelFileError(InputError):
    """A GGUF file is missing, unreadable, truncated, or not the kind of file expected."""


class ModelPairError(InputError):
    """A text model and a vision projector that cannot work together."""


class ImageError(InputError):
    """An image that is missing, unreadable or not an image."""


class BackendError(EdgeVLMError):
    """llama.cpp / mtmd refused or failed at run time."""


class DoesNotFit(EdgeVLMError):
    """The plan found no configuration that fits the memory available; says by how much."""
