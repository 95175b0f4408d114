"""Recordings before the audio encoder: streaming decode of any file FFmpeg reads to mono float32
at the encoder's rate, under length and audio-bomb limits (``decode``); long silences found on
the fly by an energy rule (``silence``); and the recording cut into encoder-window pieces under a
token budget, decoding no further than the budget reaches (``plan``). PyAV (the ``video`` extra)
is imported only when a file is opened."""

from .decode import SAMPLE_RATE, AudioInfo, AudioLimits, AudioStream, iter_samples, probe
from .plan import AudioPiece, AudioPlan, plan_audio
from .silence import SilenceRule, SilenceSplitter, kept_spans

__all__ = [
    "SAMPLE_RATE",
    "AudioInfo",
    "AudioLimits",
    "AudioPiece",
    "AudioPlan",
    "AudioStream",
    "SilenceRule",
    "SilenceSplitter",
    "iter_samples",
    "kept_spans",
    "plan_audio",
    "probe",
]
