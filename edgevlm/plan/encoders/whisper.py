"""The Whisper audio encoder (projectors ``ultravox``, ``qwen2a`` — a ``qwen2.5o`` file's audio
half —, ``voxtral``, ``musicflamingo``): its own clip context's compute buffer, replayed node by
node through ``plan.graphalloc`` as ``tools/mtmd/models/whisper-enc.cpp`` builds the graph.

Every window mtmd encodes is 3000 log-mel frames (30 s), the warm-up size too, so the buffer is
one number per file: it does not depend on the recording's length. The graph, for ``n_mel``
mel bins and width ``E`` (N = 1500 positions):

- ``inp_raw`` F32 (3000, n_mel); two ``ggml_conv_1d_ph`` (kernel 3; stride 1, then 2), each an
  IM2COL (F16; F32 for a BF16 kernel), a MUL_MAT with the reshaped kernel and a reshape, then
  the bias ADD and GELU (erf) in place; a transpose + CONT to (E, 1500);
- clip.cpp's ``build_vit``: the learned positions (a view of the first 1500 rows, no GET_ROWS)
  added in place, no pre-norm, per block LayerNorms with biases, Q and V with biases and K
  without, ``build_attn`` (``plan.compute.vit_attention``: flash attention on F16 copies of K
  and V, or KQ → soft-max → KQV: 1500² per head in F32), the output projection with bias, and
  the GELU FFN with biases; the residual adds in place. Q, K and V join the graph when each
  block is built (``ggml_build_forward_order``), which is their order here too;
- the 2× average pool (``qwen2a``, ``voxtral``, ``musicflamingo``: transpose, CONT, POOL_1D,
  transpose, CONT; clip.cpp ``build_vit``), the post-LayerNorm (``a.post_ln``, when the file has
  it), a reshape;
- the projector: frames stacked by the stack factor (``build_stack``: a view, with a PAD first
  when the rows do not divide), then per type — ``ultravox``: RMS norm × w, MUL_MAT, SwiGLU
  (swapped halves), RMS norm × w, MUL_MAT; ``qwen2a``: MUL_MAT + bias; ``voxtral`` and
  ``musicflamingo``: MUL_MAT + bias, GELU (erf), MUL_MAT + bias.

What the ``AudioEncoderInfo`` does not say (the Ultravox projector's hidden width, whether the
file has a post-norm, the convolution's type) is read from the file's tensor table
(``WhisperTensors.from_gguf``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedModel
from ...model.audio import AudioEncoderInfo, audio_facts
from ...model.gguf_info import GGUFFile
from ..compute import vit_attention
from ..graphalloc import F16, F32, Graph, Tensor, pad
from ..sched import Backend, encoder_bytes

__all__ = ["WINDOW_FRAMES", "WhisperTensors", "compute_bytes", "whisper_graph"]

WINDOW_FRAMES = 3000  # every window mtmd encodes, and clip's warm-up (warmup_audio_size)
_PROJECTORS = ("ultravox", "qwen2a", "voxtral", "musicflamingo")


@dataclass(frozen=True)
class WhisperTensors:
    """The facts of a Whisper projector file the graph needs beyond ``AudioEncoderInfo``."""

    proj_hidden: int = 0  # rows of ``mm.a.mlp.1.weight`` (Ultravox, Voxtral: the first linear)
    post_ln: bool = True  # ``a.post_ln.weight`` present
    pre_ln: bool = False  # ``a.pre_ln.weight`` present (Whisper has none)
    conv_type: str = F16  # im2col's type: F16, F32 for a BF16 kernel (ggml_conv_1d)

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> WhisperTensors:
        mlp1 = gf.tensor("mm.a.mlp.1.weight")
        conv = gf.tensor("a.conv1d.1.weight")
        return cls(
            proj_hidden=int(mlp1.shape[1]) if mlp1 is not None and len(mlp1.shape) > 1 else 0,
            post_ln=gf.tensor("a.post_ln.weight") is not None,
            pre_ln=gf.tensor("a.pre_ln.weight") is not None,
            conv_type=F32 if conv is not None and conv.ggml_type.upper() == "BF16" else F16,
        )


def whisper_graph(
    a: AudioEncoderInfo, flash_attn: bool, t: WhisperTensors = WhisperTensors(), n_frames: int = WINDOW_FRAMES
) -> Graph:
    """The reserve graph of the audio clip context for one window of ``n_frames`` frames."""
    ptype = a.projector_type
    if ptype not in _PROJECTORS:
        raise UnsupportedModel(f"no audio encoder graph for projector type {ptype!r}")
    f = audio_facts(ptype)
    g = Graph()
    W = g.EXT
    E, H, F, M = a.n_embd, a.n_head, a.n_ff, a.n_mel
    D = E // H
    N = n_frames // 2  # n_pos (whisper-enc.cpp); the stride-2 conv gives (n_frames - 1) // 2 + 1

    def conv1d(x: Tensor, ic: int, stride: int) -> Tensor:
        """ggml_conv_1d_ph (kernel 3, padding 1) + bias + GELU: (frames out, E)."""
        ol = (x.ne[0] + 2 - 2 - 1) // stride + 1
        col = g.op("IM2COL", t.conv_type, (3 * ic, ol), W, x)
        colr = g.view(col, (3 * ic, ol), op="RESHAPE")
        wr = g.view(W, (3 * ic, E), op="RESHAPE")
        mm = g.op("MUL_MAT", F32, (ol, E), colr, wr)
        y = g.view(mm, (ol, E, 1), op="RESHAPE")
        y = g.op("ADD", F32, (ol, E), y, W)
        return g.op("UNARY", F32, (ol, E), y)  # gelu_erf

    inp_raw = g.input("inp_raw", F32, (n_frames, M))
    x = conv1d(inp_raw, M, 1)
    x = conv1d(x, E, 2)
    n_conv = x.ne[0]
    x = g.view(x, (E, n_conv), op="TRANSPOSE", nb=(4 * n_conv, 4, 4 * n_conv * E, 4 * n_conv * E))
    x = g.op("CONT", F32, (E, n_conv), x, name="after_conv1d")
    pos = g.view(W, (E, N))  # the first N rows of a.position_embd
    x = g.op("ADD", F32, (E, N), x, pos)
    x = g.view(x, (E, N), op="RESHAPE")

    def norm(v: Tensor, rows: int) -> Tensor:
        v = g.op("NORM", F32, (E, rows), v)
        v = g.op("MUL", F32, (E, rows), v, W)
        return g.op("ADD", F32, (E, rows), v, W)

    def linear(v: Tensor, n_out: int, rows: int, bias: bool = True, name: str = "") -> Tensor:
        v = g.op("MUL_MAT", F32, (n_out, rows), W, v, name=name)
        return g.op("ADD", F32, (n_out, rows), v, W) if bias else v

    if t.pre_ln:
        x = norm(x, N)
    inpL = x
    heads = (D, H, N)
    for il in range(a.n_layer):
        cur = norm(inpL, N)
        q = g.view(linear(cur, E, N, name=f"Qcur-{il}"), heads, op="RESHAPE")
        k = g.view(linear(cur, E, N, bias=False, name=f"Kcur-{il}"), heads, op="RESHAPE")
        v = g.view(linear(cur, E, N, name=f"Vcur-{il}"), heads, op="RESHAPE")
        cur = vit_attention(g, q, k, v, il, D, H, N, E, flash_attn)
        cur = linear(cur, E, N, name=f"attn_out-{il}")
        cur = g.op("ADD", F32, (E, N), cur, inpL)  # ffn_inp
        inpL = cur
        cur = norm(cur, N)
        cur = linear(cur, F, N, name=f"ffn_up-{il}")
        cur = g.op("UNARY", F32, (F, N), cur)  # gelu_erf
        cur = linear(cur, E, N, name=f"ffn_down-{il}")
        inpL = g.op("ADD", F32, (E, N), inpL, cur)  # layer_out
    x = inpL
    rows = N
    if f.avgpool:  # clip.cpp build_vit: transpose, cont, pool_1d(avg, 2, 2), transpose, cont
        x = g.view(x, (N, E), op="TRANSPOSE", nb=(4 * E, 4, 4 * E * N, 4 * E * N))
        x = g.op("CONT", F32, (N, E), x)
        rows = (N - 2) // 2 + 1
        x = g.op("POOL_1D", F32, (rows, E), x)
        x = g.view(x, (E, rows), op="TRANSPOSE", nb=(4 * rows, 4, 4 * rows * E, 4 * rows * E))
        x = g.op("CONT", F32, (E, rows), x)
    if t.post_ln:
        x = norm(x, rows)
    x = g.view(x, (E, rows, 1), op="RESHAPE")
    width = E
    sf = a.stack_factor if f.stack else 1
    if sf > 1:  # build_stack: pad the rows up to a multiple of the factor, then a 2-D view
        total = E * rows
        padded = pad(total, E * sf)
        if padded > total:
            x = g.view(x, (total,))
            x = g.op("PAD", F32, (padded,), x)
        width, rows = E * sf, padded // (E * sf)
        x = g.view(x, (width, rows))
    out = a.n_mmproj_embd
    if ptype == "ultravox":
        hid = t.proj_hidden or 2 * E
        x = g.op("RMS_NORM", F32, (width, rows), x)
        x = g.op("MUL", F32, (width, rows), x, W)  # mm.a.norm_pre
        x = g.op("MUL_MAT", F32, (hid, rows), W, x, name="mm_1")
        x = g.op("GLU", F32, (hid // 2, rows), x)  # swiglu_swapped
        x = g.op("RMS_NORM", F32, (hid // 2, rows), x)
        x = g.op("MUL", F32, (hid // 2, rows), x, W)  # mm.a.norm_mid
        g.op("MUL_MAT", F32, (out, rows), W, x, name="mm_2")
    elif ptype == "qwen2a":
        x = g.op("MUL_MAT", F32, (out, rows), W, x, name="mm_fc")
        g.op("ADD", F32, (out, rows), x, W)
    else:  # voxtral, musicflamingo: build_ffn(mm.a.mlp.1 + b, GELU erf, mm.a.mlp.2 + b)
        hid = t.proj_hidden or out
        x = g.op("MUL_MAT", F32, (hid, rows), W, x, name="mm_1")
        x = g.op("ADD", F32, (hid, rows), x, W)
        x = g.op("UNARY", F32, (hid, rows), x)
        x = g.op("MUL_MAT", F32, (out, rows), W, x, name="mm_2")
        g.op("ADD", F32, (out, rows), x, W)
    return g


def compute_bytes(
    a: AudioEncoderInfo,
    flash_attn: bool,
    tensors: WhisperTensors = WhisperTensors(),
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """The audio clip context's compute buffer (``reserve_compute_meta``) for one window: on
    the CPU, or on ``gpu`` (``host``: the host-side buffer then, the mel frames it fills)."""
    return encoder_bytes(whisper_graph(a, flash_attn, tensors), gpu, host)
