"""edgevlm: vision-language models on laptops through llama.cpp, planned to fit in memory."""

from .api import load
from .engine import ChatResult, Engine, GenerationResponse
from .errors import (
    BackendError,
    EdgeVLMError,
    ImageError,
    InputError,
    ModelFileError,
    ModelPairError,
)
from .families import ImageTokens, image_tokens
from .gguf_info import ProjectorInfo, TextModelInfo, check_pair, load_projector, load_text_model
from .images import LoadedImage, load_image
from .stats import TurnStats

__version__ = "0.1.0"

__all__ = [
    "ChatResult",
    "Engine",
    "GenerationResponse",
    "LoadedImage",
    "TurnStats",
    "load",
    "load_image",
    "BackendError",
    "EdgeVLMError",
    "ImageError",
    "ImageTokens",
    "InputError",
    "ModelFileError",
    "ModelPairError",
    "ProjectorInfo",
    "TextModelInfo",
    "check_pair",
    "image_tokens",
    "load_projector",
    "load_text_model",
]
