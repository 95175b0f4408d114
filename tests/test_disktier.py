"""The disk tier on its own (real files in the saved-conversation format, no model): bounded by
bytes with the least recently used file out, a sequence that continues another replaces it, a
restart finds what the last one wrote and skips what another model wrote, a damaged file is
dropped instead of loaded, and one folder takes one tier at a time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgevlm.errors import InputError
from edgevlm.runtime.disktier import DiskTier
from edgevlm.runtime.items import Item, text_items
from edgevlm.runtime.saved import Binding, FileId

BOUND = Binding(FileId("m.gguf", 10, "aa"), FileId("p.gguf", 5, "bb"), 1024, "f16", "f16", True, "0-0")
OTHER = Binding(FileId("m2.gguf", 10, "cc"), FileId("p.gguf", 5, "bb"), 1024, "f16", "f16", True, "0-0")


def seq(*tokens: int) -> tuple[Item, ...]:
    return (*text_items(tokens), Item(("i", "abc@0-0", 0), 16, 16))


def written(tier: DiskTier, n: int) -> None:
    deadline = time.monotonic() + 30
    while tier.written < n:
        assert time.monotonic() < deadline, "the writer did not write"
        tier.flush(deadline)


def test_the_least_recently_used_file_goes_past_the_bound(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=3 * 3000, binding=BOUND, version="t")
    try:
        for i in range(3):
            assert tier.put(seq(100 + i), bytes([i]) * 2000)
        written(tier, 3)
        assert len(tier) == 3
        first, k = tier.best(seq(100))
        assert first is not None
        assert k == 2
        assert tier.data(first) == bytes([0]) * 2000  # read back: now the most recently used
        assert tier.put(seq(200), b"\x09" * 2000)
        written(tier, 4)
        held = {t for t in (100, 101, 102, 200) if tier.best(seq(t))[1] == 2}
        assert held == {100, 102, 200}  # 101 was the least recently used
        assert tier.nbytes <= tier.max_bytes
        assert len(list(tmp_path.glob("*.evlm"))) == 3
        # a sequence that continues another holds all of it: the shorter one goes
        assert tier.put((*seq(200), *text_items([7, 8])), b"\x0a" * 2100)
        written(tier, 5)
        entry, k = tier.best((*seq(200), *text_items([7, 8, 9])))
        assert entry is not None
        assert k == 4
        assert len(list(tmp_path.glob("*.evlm"))) == 3
    finally:
        tier.close()


def test_a_restart_finds_its_files_skips_another_models_and_drops_a_damaged_one(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=2**20, binding=BOUND, version="t")
    tier.put(seq(1), b"one" * 100)
    tier.put(seq(2), b"two" * 100)
    tier.close()
    theirs = DiskTier(str(tmp_path), max_bytes=2**20, binding=OTHER, version="t")
    assert theirs.ignored == 2
    assert len(theirs) == 0  # another model's files: not loaded ...
    theirs.put(seq(3), b"three" * 100)
    theirs.close()
    again = DiskTier(str(tmp_path), max_bytes=2**20, binding=BOUND, version="t")
    try:
        assert again.ignored == 1  # ... and not deleted
        assert len(list(tmp_path.glob("*.evlm"))) == 3
        entry, _ = again.best(seq(1))
        assert entry is not None
        assert again.data(entry) == b"one" * 100
        other, _ = again.best(seq(2))
        assert other is not None
        raw = bytearray(Path(other.path).read_bytes())
        raw[-40] ^= 0xFF
        Path(other.path).write_bytes(bytes(raw))
        assert again.data(other) is None  # the checksum caught it: dropped, never loaded
        assert again.best(seq(2))[0] is None
    finally:
        again.close()


def test_one_folder_takes_one_tier(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=2**20, binding=BOUND, version="t")
    try:
        with pytest.raises(InputError, match=r"in use by another edgevlm serve \(process \d+\)"):
            DiskTier(str(tmp_path), max_bytes=2**20, binding=BOUND, version="t")
    finally:
        tier.close()
    DiskTier(str(tmp_path), max_bytes=2**20, binding=BOUND, version="t").close()  # free again once closed
