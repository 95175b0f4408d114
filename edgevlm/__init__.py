"""edgevlm: vision-language models on laptops through llama.cpp, planned to fit in memory."""

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

__version__ = "0.1.0"

__all__ = [
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
