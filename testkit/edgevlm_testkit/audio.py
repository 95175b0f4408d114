"""Random-weight audio projectors in the layout the vendored mtmd (llama-cpp-python 0.3.36)
loads, and the pairs ``model_pair("ultravox")`` / ``model_pair("qwen25o")`` write.

* ``ultravox`` (audio only): a Whisper encoder (``a.*``) + Ultravox's stacked-frame SwiGLU
  projector (``mm.a.*``); clip.cpp ``load_tensors`` case ULTRAVOX, graph ``models/whisper-enc.cpp``.
* ``qwen2.5o`` (vision + audio in one file): Qwen2.5-VL's ViT (``v.*``, ``mm.0``/``mm.2``) and a
  Whisper encoder with Qwen2-Audio's avg-pool + linear projector (``mm.a.fc``); clip.cpp splits the
  one ``clip.projector_type = qwen2.5o`` into QWEN25VL for the vision context and QWEN2A for the
  audio one.

Whisper layout (convert ``conversion/ultravox.py`` / ``qwenvl.py`` + ``gguf-py`` tensor_mapping):
conv kernels are F16 (``tensor_force_quant``), conv biases are (E, 1) (``unsqueeze(-1)``), the
key projection has no bias (whisper-enc.cpp asserts it), the position table has >= 1500 rows
(n_frames / 2 for the 3000-frame window). Shapes below are PyTorch order; gguf-py reverses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .llava import write_llama_text
from .qwen import qwen_vision_into, write_qwen2vl_text
from .shapes import LLAVA_PRESETS, QWEN_PRESETS, VisionShape
from .writer import FILE_TYPES, RandomGGUF

WHISPER_POSITIONS = 1500  # 3000 mel frames per 30 s window, halved by the stride-2 conv


@dataclass(frozen=True)
class AudioShape:
    n_embd: int  # whisper d_model (1280 for large-v3 / turbo)
    n_layer: int
    n_head: int
    n_ff: int
    n_mel: int = 128  # 128 for whisper-large-v3 (Ultravox 0.5, Qwen2.5-Omni); 80 for older
    stack_factor: int = 8  # Ultravox: 8; Voxtral: 4 (unused by qwen2a)
    proj_hidden: int = 0  # Ultravox linear_1 output (split in two by SwiGLU); 0: 2 * n_embd


def _whisper_header(w, a: AudioShape, n_text_embd: int) -> None:
    w.add_bool("clip.has_audio_encoder", True)
    w.add_uint32("clip.audio.num_mel_bins", a.n_mel)
    w.add_uint32("clip.audio.embedding_length", a.n_embd)
    w.add_uint32("clip.audio.feed_forward_length", a.n_ff)
    w.add_uint32("clip.audio.projection_dim", n_text_embd)
    w.add_uint32("clip.audio.attention.head_count", a.n_head)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.audio.block_count", a.n_layer)


def _whisper_tensors(g: RandomGGUF, a: AudioShape) -> None:
    """The Whisper encoder: two convs, sinusoid-like positions, pre-norm blocks, final norm."""
    E = a.n_embd
    g.weight("a.conv1d.1.weight", (E, a.n_mel, 3), qtype="f16")
    g._add("a.conv1d.1.bias", g.rng.standard_normal((E, 1), dtype=np.float32) * np.float32(0.02), "f32")
    g.weight("a.conv1d.2.weight", (E, E, 3), qtype="f16")
    g._add("a.conv1d.2.bias", g.rng.standard_normal((E, 1), dtype=np.float32) * np.float32(0.02), "f32")
    g.weight("a.position_embd.weight", (WHISPER_POSITIONS, E), scale=0.02, qtype="f32")
    for i in range(a.n_layer):
        p = f"a.blk.{i}"
        g.norm(f"{p}.ln1", E)
        g.linear(f"{p}.attn_q", E, E)
        g.linear(f"{p}.attn_k", E, E, bias=False)  # whisper: k_proj has no bias
        g.linear(f"{p}.attn_v", E, E)
        g.linear(f"{p}.attn_out", E, E)
        g.norm(f"{p}.ln2", E)
        g.linear(f"{p}.ffn_up", a.n_ff, E)  # fc1
        g.linear(f"{p}.ffn_down", E, a.n_ff)  # fc2
    g.norm("a.post_ln", E)  # audio_tower.layer_norm / ln_post


def write_ultravox_mmproj(path: Path, a: AudioShape, n_text_embd: int, seed: int, name: str) -> Path:
    """An audio-only ``ultravox`` projector file (Ultravox 0.5 layout)."""
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", False)
    w.add_string("clip.projector_type", "ultravox")
    _whisper_header(w, a, n_text_embd)
    w.add_uint32("clip.audio.projector.stack_factor", a.stack_factor)
    _whisper_tensors(g, a)
    stacked = a.n_embd * a.stack_factor
    hidden = a.proj_hidden or 2 * a.n_embd
    g.ones("mm.a.norm_pre.weight", stacked)  # RMS norm over the stacked frames
    g.weight("mm.a.mlp.1.weight", (hidden, stacked))  # linear_1, no bias
    g.ones("mm.a.norm_mid.weight", hidden // 2)  # after SwiGLU halves the width
    g.weight("mm.a.mlp.2.weight", (n_text_embd, hidden // 2))  # linear_2, no bias
    return g.write()


def write_qwen25_omni_mmproj(path: Path, v: VisionShape, a: AudioShape, n_text_embd: int, seed: int, name: str) -> Path:
    """One ``qwen2.5o`` file holding Qwen2.5-VL's ViT and Qwen2-Audio's Whisper encoder."""
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    qwen_vision_into(g, v, n_text_embd, True, "qwen2.5o")  # (one type: clip.cpp splits it per modality)
    _whisper_header(w, a, n_text_embd)
    _whisper_tensors(g, a)
    g.linear("mm.a.fc", n_text_embd, a.n_embd)  # audio_tower.proj (after the 2x avg pool)
    return g.write()


# --- mtmd's token arithmetic for these encoders (mtmd-audio.cpp + clip_n_output_tokens) -------


def whisper_chunks(n_samples: int, sample_rate: int = 16000, hop: int = 160, n_fft: int = 400) -> int:
    """30 s windows mtmd cuts from ``n_samples``: the log-mel of the samples + 30 s of zeros,
    split in 3000-frame pieces, the incomplete last piece dropped."""
    n = max(n_samples, n_fft // 2 + 1)
    n_frames = (n + 30 * sample_rate) // hop + 1
    return n_frames // 3000


def whisper_chunk_tokens(projector_type: str, stack_factor: int = 0, frames: int = 3000) -> int:
    """Tokens of one whisper window as clip_n_output_tokens counts them."""
    n = frames
    if projector_type in ("ultravox", "voxtral", "meralion"):
        n = -(-n // stack_factor)  # CLIP_ALIGN(n, sf) / sf
    n //= 2  # stride-2 conv
    if projector_type in ("qwen2a", "qwen2.5o", "voxtral", "musicflamingo"):
        n //= 2  # avg pool
    return n


def whisper_graph_tokens(projector_type: str, stack_factor: int = 0, frames: int = 3000) -> int:
    """Rows the whisper-enc.cpp graph really outputs: conv (stride 2), avg pool, then stacking
    padded up (build_stack). When this differs from ``whisper_chunk_tokens`` clip_encode
    GGML_ABORTs ("expected output 187 tokens, got 188"): seen for ultravox with stack factor 8
    (every real Ultravox 0.5) and voxtral (factor 4) on the vendored llama.cpp of 0.3.36."""
    n = (frames + 2 - 3) // 2 + 1  # ggml_conv_1d_ph(k=3, s=2, p=1)
    if projector_type in ("qwen2a", "qwen2.5o", "voxtral", "musicflamingo"):
        n //= 2
    if projector_type in ("ultravox", "voxtral", "meralion"):
        n = -(-n // stack_factor)
    return n


# tiny: a 1-block Whisper 64 wide (128 mels, as large-v3); real: Whisper large-v3's width with 2 blocks
AUDIO_PRESETS = {
    "tiny": AudioShape(64, 1, 4, 128, stack_factor=4),
    "real": AudioShape(1280, 2, 20, 5120, stack_factor=4),
}


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    """``ultravox``: a llama text model + an audio-only Ultravox projector (stack factor 4: the
    factor 8 of Ultravox 0.5 aborts this llama.cpp); ``qwen25o``: a qwen2vl text model + one
    Qwen2.5-Omni file with a vision and an audio encoder."""
    a = AUDIO_PRESETS[preset]
    if family == "ultravox":
        text, _ = LLAVA_PRESETS[preset]
        model = write_llama_text(outdir / "model.gguf", text, seed, "Ultravox random (llama text)")
        mmproj = write_ultravox_mmproj(outdir / "mmproj.gguf", a, text.n_embd, seed + 1, "Ultravox Whisper random")
        return model, mmproj
    text, vision = QWEN_PRESETS[preset]
    model = write_qwen2vl_text(outdir / "model.gguf", text, seed, "Qwen2.5-Omni random (qwen2vl text)")
    mmproj = write_qwen25_omni_mmproj(outdir / "mmproj.gguf", vision, a, text.n_embd, seed + 1, "Qwen2.5-Omni random")
    return model, mmproj
