"""What edgevlm's load hands llama.cpp, field by field, against what llama-cpp-python's own
``Llama`` hands it for the same file: only the fields edgevlm means to set may differ.

A GPU build crashed inside ``llama_model_load_from_file`` when loaded through edgevlm and not
when loaded plainly (issue "The GPU path on the machines users have"); a parameter set by
accident — a patched default leaking into another load, a field written at the wrong offset, a
callback freed before the load — is the kind of cause that needs no GPU to see. Both loads run
for real (the CPU build), with llama.cpp's entry point wrapped to record the struct it got.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import pytest
from llama_cpp import _internals

from edgevlm.backend.llama import Backend
from edgevlm.backend.system import cpu_extra_buffers


def _fields(params) -> dict:
    """Every field of a ``llama_model_params`` as plain values (pointers as addresses)."""
    out = {}
    for name, _ in params._fields_:
        v = getattr(params, name)
        if isinstance(v, ctypes._Pointer) or callable(v):  # pointers and function pointers: NULL or not
            v = bool(ctypes.cast(v, ctypes.c_void_p).value)
        out[name] = v
    return out


@pytest.fixture
def recorded(monkeypatch):
    """The fields of every ``llama_model_params`` llama.cpp's model loader receives."""
    got: list[dict] = []
    real = _internals.llama_cpp.llama_model_load_from_file

    def load(path, params):
        got.append(_fields(params))
        return real(path, params)

    monkeypatch.setattr(_internals.llama_cpp, "llama_model_load_from_file", load)
    return got


def _plain(path: str, ngl: int) -> None:
    llm = llama_cpp.Llama(path, n_gpu_layers=ngl, verbose=False)
    llm.close()


@pytest.mark.parametrize("ngl", [-1, 2])
@pytest.mark.parametrize("extra", [None, True, False])
def test_edgevlm_passes_the_library_defaults_but_what_it_sets(model_pair, recorded, ngl, extra):
    pair = model_pair("llava15")
    _plain(str(pair.model), ngl)
    be = Backend(pair.model, pair.mmproj, n_gpu_layers=ngl, extra_buffers=extra)
    be.close()
    plain, ours = recorded
    want_extra = cpu_extra_buffers() if extra is None else extra
    expected = {"use_extra_bufts": want_extra} if want_extra != plain["use_extra_bufts"] else {}
    differ = {k: v for k, v in ours.items() if v != plain[k]}
    assert differ == expected, (differ, plain)


def test_no_gpu_layer_loads_the_text_model_without_gpus(model_pair, recorded):
    """``--ngl 0``: llama.cpp keeps no GPU in the text model (``split_mode`` none, ``main_gpu``
    -1), so host weights are placed as on a CPU-only build; nothing else differs."""
    pair = model_pair("llava15")
    _plain(str(pair.model), 0)
    Backend(pair.model, pair.mmproj, n_gpu_layers=0, extra_buffers=True).close()
    plain, ours = recorded
    differ = {k: v for k, v in ours.items() if v != plain[k]}
    differ.pop("use_extra_bufts", None)
    assert differ == {"split_mode": llama_cpp.LLAMA_SPLIT_MODE_NONE, "main_gpu": -1}


def test_a_progress_callback_is_the_only_other_difference_and_is_called(model_pair, recorded):
    pair = model_pair("llava15")
    _plain(str(pair.model), -1)
    seen: list[float] = []
    Backend(pair.model, pair.mmproj, n_gpu_layers=-1, extra_buffers=True, progress_callback=seen.append).close()
    plain, ours = recorded
    differ = {k: v for k, v in ours.items() if v != plain[k] and k != "use_extra_bufts"}
    assert differ == {"progress_callback": True}
    assert seen and seen[-1] == 1.0


def test_patched_defaults_do_not_leak_into_the_next_plain_load(model_pair, recorded):
    """edgevlm patches llama-cpp-python's default-params factories for its constructor only: a
    plain load after it gets the library's own values again."""
    pair = model_pair("llava15")
    _plain(str(pair.model), -1)
    Backend(pair.model, pair.mmproj, n_gpu_layers=-1, extra_buffers=not cpu_extra_buffers(),
            progress_callback=lambda p: None).close()  # fmt: skip
    _plain(str(pair.model), -1)
    assert recorded[0] == recorded[2]


def test_the_patched_defaults_are_only_what_llama_has_no_keyword_for():
    """#57's judgement on ``backend.llama._llama_defaults``: it sets ``n_seq_max`` and
    ``kv_unified`` (a server's conversations), ``progress_callback`` (the load bar) and
    ``use_extra_bufts`` (the CPU buffers the plan counts) through the library's own parameter
    factories because ``Llama`` takes none of them as a keyword. The day the binding takes one,
    this fails and that patch goes: the keyword is the way in."""
    import inspect

    keywords = set(inspect.signature(llama_cpp.Llama.__init__).parameters)
    assert not keywords & {"n_seq_max", "kv_unified", "progress_callback", "use_extra_bufts"}
