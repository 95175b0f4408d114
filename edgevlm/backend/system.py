"""llama.cpp facts that need no loaded model: the devices ggml registered and their free
memory, whether the CPU build repacks quantized weights, the chat-template renderer, and the
route of llama.cpp's two loggers into ``logs``. Like ``llama``, this touches ``llama_cpp``."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from . import logs
from .native import require

__all__ = [
    "EXTRA_BUFFERS_ENV",
    "build_info",
    "MAX_THREADS",
    "GGMLDevice",
    "cpu_extra_buffers",
    "cpu_repacks",
    "placement",
    "default_threads",
    "ggml_devices",
    "install_log_sink",
    "template_renderer",
]

MAX_THREADS = 8  # past ~8 threads llama.cpp's CPU kernels wait on memory, not on cores


def default_threads() -> int:
    """llama.cpp's threads when none are asked for: the physical cores (psutil; a hyper-threaded
    4-core laptop has 8 logical ones, and 8 threads there are usually slower than 4), at most
    ``MAX_THREADS``."""
    return max(1, min(psutil.cpu_count(logical=False) or os.cpu_count() or 1, MAX_THREADS))


KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
_callbacks: list[object] = []  # keep ctypes callbacks alive for the life of the process


@dataclass(frozen=True)
class GGMLDevice:
    name: str
    description: str
    kind: str  # cpu | gpu | igpu | accel | meta
    free: int
    total: int
    align: int = 32  # its buffer type's alignment
    max_alloc: int = 0  # the largest buffer it allocates in one piece (0: no limit)
    max_tensor: int = 0  # the largest tensor an op on it may touch (0: no limit)
    host_buffer: str = ""  # its pinned host buffer type, if any ("Vulkan_Host", "CUDA_Host")
    host_align: int = 32


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _bind(lib) -> None:
    """ctypes signatures of the ggml calls the probe makes (idempotent)."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for fn, res, args in (
        ("ggml_backend_dev_count", sz, []),
        ("ggml_backend_dev_get", vp, [sz]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]),
        ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        ("ggml_backend_dev_buffer_type", vp, [vp]),
        ("ggml_backend_dev_host_buffer_type", vp, [vp]),
        ("ggml_backend_buft_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_buft_get_alignment", sz, [vp]),
        ("ggml_backend_buft_get_max_size", sz, [vp]),
        ("ggml_tensor_overhead", sz, []),
        ("ggml_init", vp, [_InitParams]),
        ("ggml_free", None, [vp]),
        ("ggml_new_tensor_1d", vp, [vp, ctypes.c_int, ctypes.c_int64]),
        ("ggml_add", vp, [vp, vp, vp]),
        ("ggml_backend_dev_supports_op", ctypes.c_bool, [vp, vp]),
    ):
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args


_NO_LIMIT = 1 << 48


@functools.lru_cache(maxsize=16)
def _max_tensor(lib, dev) -> int:
    """The largest f32 tensor an ADD on ``dev`` accepts, by bisection over ggml's own
    supports_op (Vulkan refuses tensors past maxStorageBufferRange); 0 when there is no limit."""

    def ok(nbytes: int) -> bool:
        ctx = lib.ggml_init(_InitParams(lib.ggml_tensor_overhead() * 4, None, True))
        try:
            a = lib.ggml_new_tensor_1d(ctx, 0, nbytes // 4)  # GGML_TYPE_F32
            return bool(lib.ggml_backend_dev_supports_op(dev, lib.ggml_add(ctx, a, a)))
        finally:
            lib.ggml_free(ctx)

    if ok(_NO_LIMIT):
        return 0
    lo, hi = 4, _NO_LIMIT  # ok(lo), not ok(hi)
    if not ok(lo):
        return 0
    while hi - lo > 4:
        mid = (lo + hi) // 8 * 4
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def install_log_sink() -> None:
    """Route llama.cpp's loggers (llama/ggml and clip/mtmd) into ``logs`` (idempotent)."""
    if _callbacks:
        return
    require()
    import llama_cpp
    from llama_cpp import mtmd_cpp

    cb = llama_cpp.llama_log_callback(logs.on_text)
    _callbacks.append(cb)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    mtmd_cpp.mtmd_helper_log_set(cb, ctypes.c_void_p(0))


def ggml_devices() -> list[GGMLDevice]:
    """Every device ggml has registered, with the free and total memory it reports."""
    require()
    import llama_cpp
    from llama_cpp import _ggml

    install_log_sink()
    llama_cpp.llama_backend_init()
    lib = _ggml.libggml
    _bind(lib)
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = KINDS.get(lib.ggml_backend_dev_type(dev), "unknown")
        facts: dict = {}
        if kind in ("gpu", "igpu"):
            buft, host = lib.ggml_backend_dev_buffer_type(dev), lib.ggml_backend_dev_host_buffer_type(dev)
            max_alloc = int(lib.ggml_backend_buft_get_max_size(buft)) if buft else 0
            facts = dict(
                align=int(lib.ggml_backend_buft_get_alignment(buft)) if buft else 32,
                max_alloc=0 if max_alloc >= _NO_LIMIT else max_alloc,
                max_tensor=_max_tensor(lib, dev),
                host_buffer=(lib.ggml_backend_buft_name(host) or b"").decode() if host else "",
                host_align=int(lib.ggml_backend_buft_get_alignment(host)) if host else 32,
            )
        out.append(
            GGMLDevice(
                (lib.ggml_backend_dev_name(dev) or b"?").decode(),
                (lib.ggml_backend_dev_description(dev) or b"").decode(),
                kind,
                int(free.value),
                int(total.value),
                **facts,
            )
        )
    return out


@functools.lru_cache(maxsize=1)
def _system_info() -> str | None:
    """llama.cpp's build features (fixed for the process: read once)."""
    require()
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode()
    except Exception:  # pragma: no cover
        return None


EXTRA_BUFFERS_ENV = "EDGEVLM_CPU_EXTRA_BUFFERS"  # "1" / "0": edgevlm's switch, over the default below


def build_info() -> tuple[str | None, str, bool]:
    """(llama-cpp-python's version, llama.cpp's feature line, whether the build can offload to
    a GPU)."""
    require()
    import llama_cpp

    return llama_cpp.__version__, (_system_info() or "").strip(), bool(llama_cpp.llama_supports_gpu_offload())


def placement(n_gpu_layers: int, extra_buffers: bool | None = None) -> dict[str, Any]:
    """The ``llama_model_params`` fields that decide where edgevlm's text model goes (a load and
    its dry run alike): the CPU's extra buffer types (``extra_buffers``; None: this CPU's
    default), and with no layer on a GPU no GPU in the model at all (``split_mode`` none,
    ``main_gpu`` -1), so its host weights get the CPU's repacked kernels, not a GPU's pinned
    host type, and no GPU context buffers."""
    require()
    import llama_cpp

    out: dict[str, Any] = {"use_extra_bufts": cpu_extra_buffers() if extra_buffers is None else extra_buffers}
    if n_gpu_layers == 0:
        out.update(split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, main_gpu=-1)
    return out


def cpu_extra_buffers() -> bool:
    """Whether weights may go to the CPU backend's extra buffer types (repacked copies for the
    AVX2/AVX-512/NEON kernels, AMX tiles); the backend loads with ``use_extra_bufts`` set to
    this. ``$EDGEVLM_CPU_EXTRA_BUFFERS`` (1 or 0) decides when set. Otherwise not where the build
    has AMX (Sapphire Rapids and later, built natively): ggml's AMX matmul, which takes Q4_0/Q8_0
    weights first, segfaults in the first decode with the pinned llama.cpp
    (ggml-org/llama.cpp#20824, seen here on every model, any thread count). Plain CPU buffers
    cost some prompt speed; a crash costs the user's work."""
    env = os.environ.get(EXTRA_BUFFERS_ENV, "").strip()
    if env in ("0", "1"):
        return env == "1"
    info = _system_info()
    return info is None or "AMX_INT8 = 1" not in info


def cpu_repacks(extra_buffers: bool | None = None) -> bool:
    """Whether this CPU build repacks Q4_0 & co for its matmul kernels (AVX2/AVX-512/NEON) when
    the extra buffer types are on (``extra_buffers``; None: :func:`cpu_extra_buffers`). Where a
    weight goes is still llama.cpp's choice: with a GPU in the model, host weights the GPU can
    multiply take that GPU's pinned host type first, which is never repacked
    (``plan.offload.host_repacks``)."""
    if not (cpu_extra_buffers() if extra_buffers is None else extra_buffers):
        return False
    info = _system_info()
    return info is None or "REPACK = 1" in info or "AVX2 = 1" in info or "NEON = 1" in info


def template_renderer(template: str, bos_token: str, eos_token: str) -> Callable[..., str]:
    """A function rendering ``messages`` with a Jinja chat template exactly as llama-cpp-python
    renders it (its ``Jinja2ChatFormatter``: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``,
    HF's ``tojson``), with the generation prompt added."""
    require()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(template, eos_token=eos_token, bos_token=bos_token, add_generation_prompt=True)
    # plain dicts: the templates read keys beyond llama-cpp-python's ChatCompletionRequest*Message TypedDicts;
    # keywords (tools, enable_thinking) reach the template as variables
    return lambda messages, **kw: fmt(messages=messages, **kw).prompt
