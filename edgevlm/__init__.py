"""edgevlm: vision-language models on laptops through llama.cpp, planned to fit in memory.

The package by layer (a lower one never imports a higher one): ``model`` (GGUF files, projector
facts) → ``backend`` (llama.cpp) → ``vision`` (pictures before the encoder) → ``plan`` (memory,
admission, the context budget) → ``runtime`` (the scheduler, the engine, the session policy) →
``caption`` / ``hub`` → ``api`` (``load``) → ``cli``.
"""

# llama.cpp's libraries first of all, before any module of ours imports numpy: a CUDA build
# crashed loading models in processes that imported numpy first (``backend.native``). Libraries
# that do not load raise nothing here: what needs them raises ``LibraryError`` (``native.require``)
from .backend import native

native.preload()

from .api import load  # noqa: E402
from .audio.budget import AudioBudget  # noqa: E402
from .backend.sampling import SamplingParams  # noqa: E402
from .errors import (  # noqa: E402
    BackendError,
    ClusterError,
    ContextExceeded,
    DoesNotFit,
    DownloadError,
    EdgeVLMError,
    ImageError,
    InputError,
    IntegrityError,
    LibraryError,
    MemoryBusy,
    ModelFileError,
    ModelPairError,
    OutputError,
    SavedStateError,
    SchemaError,
    UnsupportedModel,
)
from .model.gguf_info import ProjectorInfo, TextModelInfo, check_pair, load_projector, load_text_model  # noqa: E402
from .model.projectors import ImageTokens, image_tokens  # noqa: E402
from .runtime.engine import ChatResult, Clip, Engine, EngineOptions, GenerationResponse, Sound  # noqa: E402
from .runtime.model import LoadedModel  # noqa: E402
from .runtime.session import SessionOptions  # noqa: E402
from .runtime.stats import TurnStats  # noqa: E402
from .vision.images import LoadedImage, load_image  # noqa: E402
from .vision.merge import MergeSpec  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AudioBudget",
    "BackendError",
    "ClusterError",
    "ChatResult",
    "Clip",
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
    "LibraryError",
    "LoadedImage",
    "LoadedModel",
    "MemoryBusy",
    "MergeSpec",
    "ModelFileError",
    "ModelPairError",
    "OutputError",
    "SavedStateError",
    "ProjectorInfo",
    "SamplingParams",
    "Sound",
    "SchemaError",
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
