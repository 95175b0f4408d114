"""Read GGUF metadata and tensor tables without loading weights.

Everything here goes through the ``gguf`` package's reader (a memory map: only the header and
the tensor table are touched, so a multi-GB file inspects in milliseconds). The results are plain
frozen dataclasses that the planner, the budgeter and ``edgevlm inspect`` share.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, overload

import gguf

from ..errors import ModelFileError, ModelPairError
from .audio import AudioEncoderInfo

__all__ = [
    "GGUF_MAGIC",
    "check_pair",
    "GGUFFile",
    "HeaderIncomplete",
    "load_projector",
    "load_text_model",
    "parse_header",
    "projector_info",
    "ProjectorInfo",
    "read_gguf",
    "TensorInfo",
    "text_model_info",
    "TextModelInfo",
]

GGUF_MAGIC = b"GGUF"
# Arrays longer than this (vocabularies, merges, scores) are not decoded, only counted.
_MAX_DECODED_ARRAY = 4096
_LAYER_RE = re.compile(r"^(?:v\.|a\.)?blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # ggml order: ne[0] is the row length
    n_elements: int
    n_bytes: int
    offset: int  # absolute offset of the data in the file


@dataclass(frozen=True)
class GGUFFile:
    """The raw header of one GGUF file: metadata (small values decoded) and tensor table."""

    path: str
    file_size: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[TensorInfo, ...]

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def is_projector(self) -> bool:
        return self.arch == "clip"

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    @property
    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def layer_bytes(self) -> tuple[list[int], int]:
        """Weight bytes per block index, and the bytes of tensors outside any block."""
        per: dict[int, int] = {}
        outside = 0
        for t in self.tensors:
            m = _LAYER_RE.match(t.name)
            if m:
                i = int(m.group(1))
                per[i] = per.get(i, 0) + t.n_bytes
            else:
                outside += t.n_bytes
        n = max(per) + 1 if per else 0
        return [per.get(i, 0) for i in range(n)], outside


# GGUF value types (gguf.GGUFValueType): fixed-size scalars as struct formats
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class HeaderIncomplete(Exception):
    """The header continues past the bytes read so far."""


class _Cursor:
    """Sequential little-endian reads over the first bytes of a file (``buf``)."""

    def __init__(self, buf: bytes, file_size: int):
        self.buf = buf
        self.file_size = file_size
        self.pos = 0

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            if self.pos + n <= self.file_size and len(self.buf) < self.file_size:
                raise HeaderIncomplete()
            raise EOFError("header runs past the end of the file")

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    @overload
    def string(self, decode: Literal[True] = ...) -> str: ...
    @overload
    def string(self, decode: bool) -> str | None: ...

    def string(self, decode: bool = True) -> str | None:
        n = self.unpack("<Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace") if decode else None

    def value(self, vtype: int) -> tuple[Any, int | None]:
        """(decoded value or None for big arrays, array length or None)."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype]), None
        if vtype == _STRING:
            return self.string(), None
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            big = count > _MAX_DECODED_ARRAY
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype])
                self._need(size * count)
                if big:
                    self.pos += size * count
                    return None, count
                vals = list(struct.unpack_from("<" + _SCALARS[etype][1] * count, self.buf, self.pos))
                self.pos += size * count
                return vals, count
            if etype == _STRING:
                vals = [self.string(not big) for _ in range(count)]
                return (None if big else vals), count
            if etype == _ARRAY:  # nested arrays: walk them, keep nothing
                for _ in range(count):
                    self.value(_ARRAY)
                return None, count
            raise ValueError(f"unknown array element type {etype}")
        raise ValueError(f"unknown value type {vtype}")


def _parse(buf: bytes, path: str, size: int) -> GGUFFile:
    cur = _Cursor(buf, size)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > 10**7 or n_kv > 10**7:
        raise ModelFileError(f"{path}: corrupt GGUF header (implausible counts)")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        value, n = cur.value(cur.unpack("<I"))
        if n is not None:
            lengths[key] = n
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, shape, ttype, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    end = 0
    for name, shape, ttype, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, tsize = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: tensor {name} has unknown type {ttype}") from None
        n_el = 1
        for d in shape:
            n_el *= d
        n_bytes = n_el * tsize // block
        tensors.append(TensorInfo(name, qtype.name, shape, n_el, n_bytes, data_start + offset))
        end = max(end, data_start + offset + n_bytes)
    if end > size:
        raise ModelFileError(f"{path}: truncated GGUF: tensor data ends at byte {end:,} but the file has {size:,}")
    return GGUFFile(path, size, metadata, lengths, tuple(tensors))


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header and tensor table of ``path``; raise ModelFileError with one clear line.

    Only the header is read (through a memory map), and big arrays (vocabularies, merges) are
    skipped rather than decoded, so a multi-GB model with a 150k vocabulary answers at once.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ModelFileError(f"{p}: no such file")
    if os.path.isdir(p):
        raise ModelFileError(f"{p}: is a directory, not a GGUF file")
    try:
        size = os.path.getsize(p)
        fh = open(p, "rb")
    except OSError as exc:
        raise ModelFileError(f"{p}: cannot read ({exc.strerror or exc})") from None
    with fh:
        if size == 0:
            raise ModelFileError(f"{p}: empty file (0 bytes), not a GGUF model")
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{p}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        want = 4 * 2**20  # headers are a few MB at most (vocabulary + merges); read more if not
        while True:
            fh.seek(0)
            buf = fh.read(min(want, size))
            try:
                return parse_header(buf, p, size)
            except HeaderIncomplete:
                want *= 4


def parse_header(buf: bytes, path: str, size: int) -> GGUFFile:
    """Parse a GGUF header from the file's first bytes (``size`` = the whole file's size).

    Raises ``HeaderIncomplete`` when ``buf`` ends before the header does and the file is longer.
    """
    try:
        return _parse(buf, path, size)
    except (ModelFileError, HeaderIncomplete):
        raise
    except (struct.error, EOFError, ValueError, IndexError, OverflowError, MemoryError) as exc:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from None


def _first(v: Any) -> Any:
    """Per-layer arrays (some archs) collapse to their maximum; scalars pass through."""
    if isinstance(v, list):
        return max(v) if v else None
    return v


def _file_type_name(gf: GGUFFile) -> str:
    ft = gf.metadata.get("general.file_type")
    if ft is not None:
        try:
            name = gguf.LlamaFileType(int(ft)).name
            return name.replace("MOSTLY_", "").replace("ALL_", "")
        except ValueError:
            return f"unknown({ft})"
    # No key: report the type that holds most bytes among 2-D tensors.
    by_type: dict[str, int] = {}
    for t in gf.tensors:
        if len(t.shape) >= 2:
            by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.n_bytes
    return max(by_type, key=by_type.__getitem__) if by_type else "unknown"


@dataclass(frozen=True)
class TextModelInfo:
    path: str
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    file_type: str
    file_size: int
    weight_bytes: int
    weight_bytes_per_layer: list[int]
    weight_bytes_outside_layers: int
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window (iSWA archs)
    n_deepstack: int = 0  # Qwen3-VL: vision features added after the first n layers
    chat_template: str | None = field(default=None, repr=False)
    kind: str = "text"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["has_chat_template"] = self.chat_template is not None
        del d["chat_template"]
        return d


@dataclass(frozen=True)
class ProjectorInfo:
    path: str
    projector_type: str
    name: str
    image_size: int
    patch_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    n_mmproj_embd: int  # width of the embeddings fed to the text model
    file_type: str
    file_size: int
    weight_bytes: int
    image_mean: list[float] | None = None
    image_std: list[float] | None = None
    feature_layer: list[int] | None = None
    image_grid_pinpoints: list[tuple[int, int]] | None = None
    mm_patch_merge_type: str | None = None
    spatial_merge_size: int | None = None
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    n_wa_pattern: int | None = None  # Qwen2.5-VL: every n-th block has full attention
    has_vision_encoder: bool = True
    has_audio_encoder: bool = False
    kind: str = "mmproj"
    audio: AudioEncoderInfo | None = None  # the file's audio encoder (``model.audio``), if any
    # every clip.* key of the GGUF (family-specific ones: scale factors, tile limits, ...)
    meta: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # mtmd's own count, (width, height, min_tokens, max_tokens) -> ImageTokens, once loaded
    counter: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("meta", "counter", "audio")}
        d["audio"] = self.audio.to_dict() if self.audio is not None else None
        d = {k: list(v) if isinstance(v, list) else v for k, v in d.items()}
        if self.image_grid_pinpoints is not None:
            d["image_grid_pinpoints"] = [list(p) for p in self.image_grid_pinpoints]
        return d


def _need(gf: GGUFFile, key: str) -> Any:
    if key not in gf.metadata:
        raise ModelFileError(f"{gf.path}: GGUF metadata lacks required key '{key}'")
    return gf.metadata[key]


def text_model_info(gf: GGUFFile) -> TextModelInfo:
    if gf.is_projector:
        raise ModelFileError(f"{gf.path}: is a vision projector (mmproj), not a language model; pass it with --mmproj")
    arch = gf.arch
    if not arch:
        raise ModelFileError(f"{gf.path}: GGUF metadata lacks 'general.architecture'")
    md = gf.metadata
    n_layer = int(_need(gf, f"{arch}.block_count"))
    n_embd = int(_need(gf, f"{arch}.embedding_length"))
    n_head = int(_first(_need(gf, f"{arch}.attention.head_count")))
    n_head_kv = int(_first(md.get(f"{arch}.attention.head_count_kv", n_head)))
    head_dim = int(md.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    n_ff = int(_first(md.get(f"{arch}.feed_forward_length", 0)) or 0)
    n_vocab = gf.array_lengths.get("tokenizer.ggml.tokens")
    if n_vocab is None:
        toks = md.get("tokenizer.ggml.tokens")
        n_vocab = len(toks) if isinstance(toks, list) else int(md.get(f"{arch}.vocab_size", 0))
    per_layer, outside = gf.layer_bytes()
    return TextModelInfo(
        path=gf.path,
        arch=arch,
        name=str(md.get("general.name", os.path.basename(gf.path))),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=int(n_vocab),
        n_ctx_train=int(md.get(f"{arch}.context_length", 0)),
        file_type=_file_type_name(gf),
        file_size=gf.file_size,
        weight_bytes=gf.weight_bytes,
        weight_bytes_per_layer=per_layer,
        weight_bytes_outside_layers=outside,
        n_swa=int(md.get(f"{arch}.attention.sliding_window", 0) or 0),
        swa_layers=_swa_layers(md, arch, n_layer),
        n_deepstack=int(md.get(f"{arch}.n_deepstack_layers", 0) or 0),
        chat_template=md.get("tokenizer.chat_template"),
    )


_SWA_PATTERN = {"gemma3": 6}  # llama.cpp's default sliding_window_pattern per architecture


def _swa_layers(md: dict[str, Any], arch: str, n_layer: int) -> tuple[bool, ...]:
    """Which layers use the sliding window (llama_hparams::set_swa_pattern, dense_first false):
    every layer but each pattern-th; a list in the GGUF says it per layer."""
    if not md.get(f"{arch}.attention.sliding_window") or arch not in _SWA_PATTERN:
        return ()
    pat = md.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pat, list):
        return tuple(bool(x) for x in pat[:n_layer])
    p = int(pat)
    return tuple(p == 0 or il % p < p - 1 for il in range(n_layer))


def _mmproj_width(gf: GGUFFile, ptype: str) -> int:
    """The embedding width the projector hands to the text model (clip_n_mmproj_embd)."""

    def out_dim(name: str, axis: int) -> int | None:
        t = gf.tensor(name)
        return t.shape[axis] if t is not None and len(t.shape) > axis else None

    candidates: list[tuple[str, int]] = {
        "gemma3": [("mm.input_projection.weight", 0)],
        "idefics3": [("mm.model.fc.weight", 1)],
        "internvl": [("mm.model.mlp.3.weight", 1)],
        "ldp": [("mm.model.mb_block.1.block.2.1.bias", 0)],
        "ldpv2": [("mm.model.peg.0.bias", 0)],
    }.get(ptype, [("mm.2.weight", 1)])
    for name, axis in candidates:
        d = out_dim(name, axis)
        if d:
            return d
    # Unknown layout: the projection_dim key is the best available hint.
    return int(gf.metadata.get("clip.vision.projection_dim", 0))


def projector_info(gf: GGUFFile) -> ProjectorInfo:
    if not gf.is_projector:
        arch = gf.arch or "unknown"
        raise ModelFileError(f"{gf.path}: is a language model (arch '{arch}'), not a vision projector (mmproj)")
    md = gf.metadata
    ptype = md.get("clip.vision.projector_type") or md.get("clip.projector_type")
    if ptype is None:
        # Old LLaVA mmproj files omit the type: clip.cpp then assumes "mlp".
        ptype = "mlp"
    has_vision = bool(md.get("clip.has_vision_encoder", False))
    audio = _audio_encoder(gf, str(ptype)) if md.get("clip.has_audio_encoder", False) else None
    if not has_vision and audio is None:
        raise ModelFileError(f"{gf.path}: mmproj has neither a vision nor an audio encoder (clip.has_*_encoder)")
    if not has_vision:
        assert audio is not None
        return ProjectorInfo(
            path=gf.path,
            projector_type=audio.projector_type,
            name=str(md.get("general.name", os.path.basename(gf.path))),
            image_size=0,
            patch_size=0,
            n_layer=0,
            n_embd=0,
            n_head=0,
            n_ff=0,
            n_mmproj_embd=audio.n_mmproj_embd,
            file_type=_file_type_name(gf),
            file_size=gf.file_size,
            weight_bytes=gf.weight_bytes,
            has_vision_encoder=False,
            has_audio_encoder=True,
            audio=audio,
            meta={k: v for k, v in md.items() if k.startswith("clip.")},
        )
    pin = md.get("clip.vision.image_grid_pinpoints")
    pinpoints = [(int(pin[i]), int(pin[i + 1])) for i in range(0, len(pin) - 1, 2)] if pin else None
    fl = md.get("clip.vision.feature_layer")
    return ProjectorInfo(
        path=gf.path,
        projector_type=_VISION_HALF.get(str(ptype), str(ptype)),
        name=str(md.get("general.name", os.path.basename(gf.path))),
        image_size=int(_need(gf, "clip.vision.image_size")),
        patch_size=int(_need(gf, "clip.vision.patch_size")),
        n_layer=int(_need(gf, "clip.vision.block_count")),
        n_embd=int(_need(gf, "clip.vision.embedding_length")),
        n_head=int(md.get("clip.vision.attention.head_count", 0)),
        n_ff=int(md.get("clip.vision.feed_forward_length", 0)),
        n_mmproj_embd=_mmproj_width(gf, str(ptype)),
        file_type=_file_type_name(gf),
        file_size=gf.file_size,
        weight_bytes=gf.weight_bytes,
        image_mean=md.get("clip.vision.image_mean"),
        image_std=md.get("clip.vision.image_std"),
        feature_layer=[int(x) for x in fl] if isinstance(fl, list) else None,
        image_grid_pinpoints=pinpoints,
        mm_patch_merge_type=md.get("clip.vision.mm_patch_merge_type"),
        spatial_merge_size=md.get("clip.vision.spatial_merge_size"),
        image_min_pixels=md.get("clip.vision.image_min_pixels"),
        image_max_pixels=md.get("clip.vision.image_max_pixels"),
        n_wa_pattern=md.get("clip.vision.n_wa_pattern"),
        has_vision_encoder=has_vision,
        has_audio_encoder=audio is not None,
        audio=audio,
        meta={k: v for k, v in md.items() if k.startswith("clip.")},
    )


# a file with both encoders under one type: its vision half, as clip.cpp splits it
_VISION_HALF = {"qwen2.5o": "qwen2.5vl_merger", "qwen3o": "qwen3vl_merger"}


def _audio_encoder(gf: GGUFFile, ptype: str) -> AudioEncoderInfo:
    """The ``clip.audio.*`` keys and ``a.*`` / ``mm.a.*`` tensors of a projector file; the
    type is ``clip.audio.projector_type``, else the file's (a ``qwen2.5o`` file's audio is
    ``qwen2a``, as clip.cpp splits it)."""
    md = gf.metadata
    atype = str(md.get("clip.audio.projector_type") or ptype)
    atype = {"qwen2.5o": "qwen2a", "qwen3o": "qwen3a"}.get(atype, atype)
    fc = gf.tensor("mm.a.mlp.2.weight") or gf.tensor("mm.a.fc.weight") or gf.tensor("mm.a.mlp.3.weight")
    return AudioEncoderInfo(
        projector_type=atype,
        n_embd=int(_need(gf, "clip.audio.embedding_length")),
        n_layer=int(_need(gf, "clip.audio.block_count")),
        n_head=int(md.get("clip.audio.attention.head_count", 0)),
        n_ff=int(md.get("clip.audio.feed_forward_length", 0)),
        n_mel=int(md.get("clip.audio.num_mel_bins", 0)),
        stack_factor=int(md.get("clip.audio.projector.stack_factor", 0)),
        n_mmproj_embd=int(fc.shape[1]) if fc is not None else int(md.get("clip.audio.projection_dim", 0)),
        weight_bytes=sum(t.n_bytes for t in gf.tensors if t.name.startswith(("a.", "mm.a."))),
    )


def load_text_model(path: str | os.PathLike[str]) -> TextModelInfo:
    return text_model_info(read_gguf(path))


def load_projector(path: str | os.PathLike[str]) -> ProjectorInfo:
    return projector_info(read_gguf(path))


def check_pair(text: TextModelInfo, proj: ProjectorInfo) -> None:
    """Raise ModelPairError if the projector's output cannot feed the text model."""
    if proj.n_mmproj_embd != text.n_embd:
        raise ModelPairError(
            f"{proj.path}: projector output width {proj.n_mmproj_embd} does not match "
            f"{os.path.basename(text.path)} n_embd {text.n_embd}; these files are not a pair"
        )
