"""Audio encoder facts, in one table, and their token arithmetic: what each mtmd audio
projector type does with a recording, decided before the encoder runs.

mtmd (the vendored llama.cpp of llama-cpp-python 0.3.36) takes 16 kHz mono float samples. The
Whisper family (``ultravox``, ``qwen2a`` — also the audio half of a ``qwen2.5o`` file —,
``voxtral``, ``meralion``, ``musicflamingo``) cuts the log-mel of the samples followed by 30 s of
zeros into 3000-frame windows, dropping the incomplete last one (``mtmd-audio.cpp``), so

    windows(n) = 1 + (max(n, 201) // 160 + 1) // 3000

and each window costs the same tokens (``clip_n_output_tokens``: stacked frames first, then the
stride-2 conv's halving, then the avg pool's). The encoder's compute buffer is the same for every
window (3000 frames, the warm-up size), so the planner sizes it once.

A projector whose graph gives another row count than mtmd's count aborts the whole process
on its first encode (``clip.cpp``: ``GGML_ABORT("Invalid number of output tokens")``): every
Ultravox 0.5 (stack factor 8) and Voxtral (factor 4) on this llama.cpp. ``refusal`` names them,
so a model is refused before anything is encoded. The encoders edgevlm does not count yet
(conformer, Gemma 4, Granite, Qwen3-Omni, ...) are refused the same way, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModel

__all__ = [
    "AUDIO_ENCODERS",
    "SAMPLE_RATE",
    "WHISPER_PIECE_SAMPLES",
    "AudioEncoderInfo",
    "AudioFacts",
    "audio_facts",
    "audio_tokens",
    "piece_samples",
    "refusal",
    "whisper_graph_rows",
    "whisper_windows",
    "window_tokens",
]

SAMPLE_RATE = 16000  # every audio input encoder of this llama.cpp (clip.cpp load_hparams)
_HOP, _N_FFT, _WINDOW_FRAMES = 160, 400, 3000  # the Whisper log-mel: 10 ms hop, 30 s windows
# the longest piece that is exactly one window: 1 + (n // 160 + 1) // 3000 == 1 up to 479_839
# samples; a round 29.98 s keeps each piece one window whatever rounding a caller does
WHISPER_PIECE_SAMPLES = 479_680


@dataclass(frozen=True)
class AudioFacts:
    """What one audio projector type does with a recording (see the module doc)."""

    family: str  # "whisper" (30 s windows, fixed cost each) | "unsupported"
    stack: bool = False  # frames stacked by the projector's stack factor (before the halving)
    avgpool: bool = False  # a 2x average pool after the conv
    reason: str = ""  # unsupported: why


_WHY_NOT = "edgevlm does not count its tokens or plan its encoder yet"
AUDIO_ENCODERS: dict[str, AudioFacts] = {
    "ultravox": AudioFacts("whisper", stack=True),
    "qwen2a": AudioFacts("whisper", avgpool=True),
    "voxtral": AudioFacts("whisper", stack=True, avgpool=True),
    "meralion": AudioFacts("whisper", stack=True),
    "musicflamingo": AudioFacts("whisper", avgpool=True),
    "gemma3na": AudioFacts("unsupported", reason="this llama.cpp cannot load Gemma 3n's audio encoder"),
}


@dataclass(frozen=True)
class AudioEncoderInfo:
    """The audio encoder of a projector file (``clip.audio.*``): its type (a ``qwen2.5o`` file's
    audio half is ``qwen2a``, as clip.cpp splits it), shape and weight bytes (its ``a.*`` and
    ``mm.a.*`` tensors: the whole-file size llama.cpp logs covers both encoders of a mixed file)."""

    projector_type: str
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_mel: int
    stack_factor: int
    n_mmproj_embd: int  # width of the embeddings fed to the text model
    weight_bytes: int
    sample_rate: int = SAMPLE_RATE

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def audio_facts(ptype: str) -> AudioFacts:
    """The table's row for an audio projector type (unknown types: unsupported)."""
    return AUDIO_ENCODERS.get(ptype, AudioFacts("unsupported", reason=_WHY_NOT))


def whisper_windows(n_samples: int) -> int:
    """The 30 s windows mtmd cuts from ``n_samples`` samples."""
    n = max(n_samples, _N_FFT // 2 + 1)
    return ((n + 30 * SAMPLE_RATE) // _HOP + 1) // _WINDOW_FRAMES


def window_tokens(a: AudioEncoderInfo) -> int:
    """Tokens of one window as mtmd counts them (``clip_n_output_tokens``)."""
    f = audio_facts(a.projector_type)
    n = _WINDOW_FRAMES
    if f.stack:
        n = -(-n // max(a.stack_factor, 1))
    n //= 2  # the stride-2 conv
    if f.avgpool:
        n //= 2
    return n


def whisper_graph_rows(a: AudioEncoderInfo) -> int:
    """Rows the encoder's graph really gives per window (``whisper-enc.cpp``: the conv, the avg
    pool, then frames stacked with padding); mtmd aborts when this is not ``window_tokens``."""
    f = audio_facts(a.projector_type)
    n = (_WINDOW_FRAMES - 1) // 2 + 1  # ggml_conv_1d_ph, kernel 3, stride 2
    if f.avgpool:
        n //= 2
    if f.stack:
        n = -(-n // max(a.stack_factor, 1))
    return n


def refusal(a: AudioEncoderInfo) -> str | None:
    """Why this llama.cpp cannot take audio through ``a`` (None: it can)."""
    f = audio_facts(a.projector_type)
    if f.family == "unsupported":
        return f"its {a.projector_type} audio encoder: {f.reason}"
    if whisper_graph_rows(a) != window_tokens(a):
        return (
            f"its {a.projector_type} audio encoder (stack factor {a.stack_factor}) aborts this llama.cpp on "
            f"its first encode (mtmd counts {window_tokens(a)} tokens per window, the graph gives "
            f"{whisper_graph_rows(a)})"
        )
    return None


def piece_samples(a: AudioEncoderInfo) -> int:
    """The most samples one piece of a recording holds: one window."""
    return WHISPER_PIECE_SAMPLES


def audio_tokens(a: AudioEncoderInfo, n_samples: int) -> int:
    """The tokens ``n_samples`` samples cost as one bitmap (every window mtmd cuts from them);
    an encoder edgevlm cannot take: ``UnsupportedModel``."""
    why = refusal(a)
    if why is not None:
        raise UnsupportedModel(f"audio: {why}")
    return whisper_windows(n_samples) * window_tokens(a)
