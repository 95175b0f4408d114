"""edgevlm: vision-language models on laptops through llama.cpp, planned to fit in memory.

The package by layer (a lower one never imports a higher one): ``model`` (GGUF files, projector
facts) → ``backend`` (llama.cpp) → ``vision`` (pictures before the encoder) → ``plan`` (memory,
admission, the context budget) → ``runtime`` (the scheduler, the engine, the session policy) →
``caption`` / ``hub`` → ``api`` (``load``) → ``cli``.
"""

from .api import load
from .backend.sampling import SamplingParams
from .errors import (
    BackendError,
    ClusterError,
    ContextExceeded,
    DoesNotFit,
    DownloadError,
    EdgeVLMError,
    ImageError,
    InputError,
    IntegrityError,
    MemoryBusy,
    ModelFileError,
    ModelPairError,
    OutputError,
    UnsupportedModel,
)
from .model.gguf_info import ProjectorInfo, TextModelInfo, check_pair, load_projector, load_text_model
from .model.projectors import ImageTokens, image_tokens
from .runtime.engine import ChatResult, Engine, EngineOptions, GenerationResponse
from .runtime.model import LoadedModel
from .runtime.session import SessionOptions
from .runtime.stats import TurnStats
from .vision.images import LoadedImage, load_image
from .vision.merge import MergeSpec

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ClusterError",
    "ChatResult",
    "ContextExceeded",
    "DoesNotFit",
    "DownloadError",
    "EdgeVLMError",
    "Engine",
    "EngineOptions",
    "GenerationResponse",
    "ImageError",
    "ImageTokens",
    "InputError",
    "IntegrityError",
    "LoadedImage",
    "LoadedModel",
    "MemoryBusy",
    "MergeSpec",
    "ModelFileError",
    "ModelPairError",
    "OutputError",
    "ProjectorInfo",
    "SamplingParams",
    "SessionOptions",
    "TextModelInfo",
    "TurnStats",
    "UnsupportedModel",
    "check_pair",
    "image_tokens",
    "load",
    "load_image",
    "load_projector",
    "load_text_model",
]
