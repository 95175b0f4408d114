"""Two copies of libstdc++ in one process: a llama.cpp library that carries its own, and the
system's, brought in before llama.cpp's libraries (numpy's extension links it).

Seen on an NVIDIA H200 (docs/gpu.md, "Loading on NVIDIA"): with numpy imported before
``llama_cpp``, a CUDA build's model load crashed in ``llama_model::print_info``, whose
``std::ostream << long`` ran ``std::ostream::_M_insert<long>`` from ``libggml-cuda.so.0`` — code
of libstdc++'s own (that function is compiled into libstdc++ and only declared in its headers),
exported by the CUDA library. A library that links libstdc++'s code in and exports it (a static
libstdc++ without ``-Wl,--exclude-libs,ALL``) lets the dynamic linker mix the two copies: some of
its own calls bind to the process's ``libstdc++.so.6``, others to its copy, and whichever copy a
caller reaches depends on what was loaded first. ``-Wl,--exclude-libs,ALL`` makes the copy
private (docs/install.md has the build line).

``conflict`` says, without loading any model, whether this process is in that state: a ggml
library (loaded, or beside the loaded ``libllama``) defines libstdc++'s own symbols in its
dynamic symbol table, and ``libstdc++.so`` was loaded before llama.cpp's first library. It reads
the link map (``dl_iterate_phdr``, load order) and each library's ``.dynsym`` with the small ELF
reader below — no ``nm`` needed. Only on Linux (ELF and libstdc++); elsewhere it answers None.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["MARKERS", "Conflict", "conflict", "exported_definitions", "loaded_objects", "runtime_copy"]

# Symbols only libstdc++'s / libsupc++'s compiled sources define (never a header's inline or
# template code): a shared library that exports one carries a copy of the runtime. The first is
# where the H200's load crashed.
MARKERS = {
    "_ZNSo9_M_insertIlEERSoT_": "std::ostream::_M_insert<long>",
    "_ZNSt6locale7classicEv": "std::locale::classic()",
    "_ZSt9terminatev": "std::terminate()",
    "__cxa_throw": "__cxa_throw",
    "__cxa_begin_catch": "__cxa_begin_catch",
    "__cxa_guard_acquire": "__cxa_guard_acquire",
    "__gxx_personality_v0": "__gxx_personality_v0",
}
_LLAMA = re.compile(r"lib(?:llama|ggml|ggml-[a-z]+|mtmd)\.so(?:\.|$)")  # llama.cpp's libraries
_GGML = re.compile(r"libggml(?:-[a-z]+)?\.so(?:\.|$)")  # the ones that may carry a backend's code
_STDCXX = re.compile(r"libstdc\+\+\.so(?:\.|$)")
_EXTENSION = re.compile(r"\.(?:cpython-[^/]*|abi3)\.so$")  # a Python extension module


def exported_definitions(path: str) -> set[str] | None:
    """The names an ELF shared library defines and exports in its dynamic symbol table (global
    or weak, default or protected visibility): what ``nm -D --defined-only`` lists. None when
    the file is not an ELF file or cannot be read."""
    try:
        with open(path, "rb") as f:
            ident = f.read(16)
            if len(ident) < 16 or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
                return None
            wide, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
            head = f.read(48 if wide else 36)
            if wide:
                shoff, shentsize, shnum = struct.unpack(end + "24xQ10xHH2x", head)
            else:
                shoff, shentsize, shnum = struct.unpack(end + "16xI10xHH2x", head)
            if not shoff or not shnum:
                return None
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            form = end + ("4xI16xQQI4x8xQ" if wide else "4xI8xIII8xI")  # type, offset, size, link, entsize
            sections = [struct.unpack_from(form, table, i * shentsize) for i in range(shnum)]
            dynsym = next((s for s in sections if s[0] == 11), None)  # SHT_DYNSYM
            if dynsym is None or dynsym[3] >= shnum:
                return set()
            _, off, size, link, entsize = dynsym
            f.seek(off)
            syms = f.read(size)
            f.seek(sections[link][1])
            strtab = f.read(sections[link][2])
    except (OSError, struct.error):
        return None
    names = set()
    sym = end + ("IBBH16x" if wide else "I8xBBH")  # name, info, other, shndx
    for i in range(len(syms) // entsize if entsize else 0):
        name, info, other, shndx = struct.unpack_from(sym, syms, i * entsize)
        if shndx == 0 or info >> 4 not in (1, 2, 10) or other & 3 not in (0, 3):
            continue  # undefined, local, or hidden / internal
        names.add(strtab[name : strtab.index(b"\0", name)].decode("ascii", "replace"))
    return names


def runtime_copy(path: str) -> list[str]:
    """libstdc++'s own functions that ``path`` defines and exports (readable names), [] when
    it carries no copy of the runtime or cannot be read."""
    names = exported_definitions(path) or set()
    return [shown for sym, shown in MARKERS.items() if sym in names]


def loaded_objects() -> list[str]:
    """The paths of the shared objects this process has loaded, in the order they were loaded
    (glibc's link map, through ``dl_iterate_phdr``); [] off Linux or where it cannot be read."""
    if not sys.platform.startswith("linux"):
        return []
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p)]

    found: list[str] = []
    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Info), ctypes.c_size_t, ctypes.c_void_p)

    def each(info: Any, _size: int, _data: int | None) -> int:  # info: a pointer to Info
        name = info.contents.name
        if name:
            found.append(os.fsdecode(name))
        return 0

    try:
        ctypes.CDLL(None).dl_iterate_phdr(callback(each), None)
    except (OSError, AttributeError):
        return []
    return found


@dataclass(frozen=True)
class Conflict:
    """A llama.cpp library carrying its own copy of libstdc++ in a process that loaded
    ``libstdc++.so`` before llama.cpp's libraries."""

    library: str  # the llama.cpp library that carries the copy
    symbols: tuple[str, ...]  # libstdc++'s own functions it exports
    brought_by: str  # the Python extension loaded just before libstdc++ ("" when none)
    modules: tuple[str, ...]  # Python modules known to bring libstdc++ that were imported

    def cause(self) -> str:
        first = (
            f"{', '.join(self.modules)} was imported before llama.cpp's libraries"
            if self.modules
            else "libstdc++ was loaded before llama.cpp's libraries"
        )
        brought = re.sub(r".*[/\\](?:site|dist)-packages[/\\]", "", self.brought_by)
        by = f" (libstdc++ came in with {brought})" if brought else ""
        shown = ", ".join(self.symbols[:2])
        return (
            f"{first}{by}, and {self.library} carries its own copy of libstdc++ (it exports {shown}): "
            "the two copies mix, and loading a model in this process crashes (a segmentation fault)"
        )


def conflict(
    objects: list[str] | None = None, folder: str | None = None, modules: tuple[str, ...] = ()
) -> Conflict | None:
    """The ``Conflict`` this process is in, or None: ``objects`` the loaded shared objects in
    load order (default ``loaded_objects()``), ``folder`` where llama.cpp's libraries lie
    (default: the loaded ``libllama``'s), ``modules`` the imported modules to name."""
    objects = loaded_objects() if objects is None else objects
    names = [os.path.basename(p) for p in objects]
    stdcxx = next((i for i, n in enumerate(names) if _STDCXX.match(n)), None)
    llama = next((i for i, n in enumerate(names) if _LLAMA.match(n)), None)
    if stdcxx is None or llama is None or stdcxx > llama:
        return None  # no libstdc++, llama.cpp not loaded, or llama.cpp's libraries brought it
    if folder is None:
        folder = next((os.path.dirname(p) for p in objects if os.path.basename(p).startswith("libllama.so")), "")
    candidates = [p for p in objects if _GGML.match(os.path.basename(p))]
    if folder and os.path.isdir(folder):
        candidates += sorted(os.path.join(folder, n) for n in os.listdir(folder) if _GGML.match(n))
    seen: set[str] = set()
    for path in candidates:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        symbols = runtime_copy(real)
        if symbols:
            brought = next((p for p in reversed(objects[:stdcxx]) if _EXTENSION.search(p)), "")
            return Conflict(path, tuple(symbols), brought, modules)
    return None
