"""Every odd image a user has loads as RGB, or fails with one clear line."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from edgevlm.errors import ImageError
from edgevlm.vision import images
from edgevlm.vision.images import decode_bytes, load_image


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 10, 20))  # blue on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    p = tmp_path / "rot.jpg"
    img.save(p, exif=exif.tobytes(), quality=95)
    out = load_image(p)
    assert (out.width, out.height) == (20, 40)
    assert out.rgb[2, 10, 2] > 200  # blue is now at the top


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "CMYK", "L", "1", "I;16", "F"])
def test_modes_become_rgb(tmp_path, mode):
    arr = (np.arange(32 * 24) % 251).reshape(24, 32).astype(np.uint8)
    img = (
        Image.fromarray(arr).convert(mode)
        if mode not in ("I;16", "F")
        else (
            Image.fromarray(arr.astype(np.uint16) * 257).convert("I;16")
            if mode == "I;16"
            else Image.fromarray(arr.astype(np.float32))
        )
    )
    ext = {"CMYK": "jpg", "F": "tiff", "I;16": "png"}.get(mode, "png")
    p = tmp_path / f"img.{ext}"
    img.save(p)
    out = load_image(p)
    assert out.rgb.dtype == np.uint8 and out.rgb.shape == (24, 32, 3)


def test_alpha_flattened_on_white(tmp_path):
    p = tmp_path / "clear.png"
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(p)
    assert load_image(p).rgb.min() == 255


def test_animated_gif_first_frame_with_note(tmp_path):
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    p = tmp_path / "anim.gif"
    frames[0].save(p, save_all=True, append_images=frames[1:], duration=100, loop=0)
    out = load_image(p)
    assert out.notes and "first" in out.notes[0]
    assert out.rgb[0, 0, 0] > 200 and out.rgb[0, 0, 1] < 50


def test_format_by_content_not_extension(tmp_path):
    p = tmp_path / "really_a_png.jpg"
    Image.new("RGB", (10, 10), (1, 2, 3)).save(p, format="PNG")
    out = load_image(p)
    assert out.format == "PNG" and tuple(out.rgb[0, 0]) == (1, 2, 3)


def test_same_pixels_same_hash_across_formats(tmp_path):
    img = Image.fromarray((np.random.default_rng(0).random((12, 9, 3)) * 255).astype(np.uint8))
    img.save(tmp_path / "a.png")
    img.save(tmp_path / "a.bmp")
    assert load_image(tmp_path / "a.png").sha256 == load_image(tmp_path / "a.bmp").sha256


def test_decompression_bomb_limit(tmp_path):
    p = tmp_path / "big.png"
    Image.new("L", (5000, 5000)).save(p)  # tiny file, 25 MP
    with pytest.raises(ImageError, match="exceeds the limit of 1,000,000"):
        load_image(p, max_pixels=1_000_000)
    assert load_image(p).width == 5000  # under the default limit


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "empty file"),
        (b"hello world", "not an image"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "image"),
    ],
)
def test_bad_bytes(tmp_path, content, needle):
    p = tmp_path / "x.png"
    p.write_bytes(content)
    with pytest.raises(ImageError, match=needle) as ei:
        load_image(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_truncated_jpeg(tmp_path):
    p = tmp_path / "t.jpg"
    Image.fromarray((np.random.default_rng(1).random((200, 200, 3)) * 255).astype(np.uint8)).save(p)
    p.write_bytes(p.read_bytes()[:2000])
    with pytest.raises(ImageError, match="corrupt or truncated"):
        load_image(p)


def test_missing_and_directory(tmp_path):
    with pytest.raises(ImageError, match="no such file"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ImageError, match="is a directory"):
        load_image(tmp_path)


# --- 16-bit and float pictures: the same pixels as before, a strip at a time -------------------


def _whole_array_scaling(img: Image.Image) -> np.ndarray:
    """How 16-bit and float greys were scaled before, on the whole picture in float64 at once
    (the reference the strip-by-strip scaling must match pixel for pixel)."""
    if img.mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        norm = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
        grey = (norm * 255).astype(np.uint8)
    else:
        arr = np.asarray(img, dtype=np.float64)
        hi = arr.max() or 1.0
        scale = 255.0 / (65535.0 if hi > 255 else 255.0)
        grey = np.clip(arr * scale, 0, 255).astype(np.uint8)
    return np.asarray(Image.fromarray(grey).convert("RGB"))


def _deep_pictures() -> dict[str, Image.Image]:
    rng = np.random.default_rng(7)
    every = np.arange(65536, dtype=np.uint16).reshape(256, 256)  # every 16-bit value once
    wide = rng.integers(-40_000, 200_000, (3, 700), dtype=np.int32)  # negatives, values past 65535
    floats = (rng.standard_normal((37, 53)) * 1e3).astype(np.float32)
    floats[0, 0], floats[-1, -1] = -3.5e4, 2.25e4  # (least and largest in different strips)
    return {
        "I;16 every value": Image.fromarray(every),
        "I;16B": Image.fromarray(every).convert("I").convert("I;16B"),
        "I;16 dim (max 200)": Image.fromarray((every % 201).astype(np.uint16)),
        "I wide": Image.fromarray(wide),
        "F": Image.fromarray(floats),
        "F flat": Image.fromarray(np.full((9, 11), 2.5, dtype=np.float32)),
        "F one row": Image.fromarray(floats.reshape(1, -1)),
    }


@pytest.mark.parametrize("strip", [1 << 18, 64])  # the default, and strips so small a row is cut in pieces
@pytest.mark.parametrize("name", list(_deep_pictures()))
def test_16_bit_and_float_pictures_scale_to_the_same_pixels_as_the_whole_array(monkeypatch, name, strip):
    monkeypatch.setattr(images, "_DEEP_STRIP_PIXELS", strip)
    img = _deep_pictures()[name]
    expected = _whole_array_scaling(img)
    assert np.array_equal(np.asarray(images.flatten(img)), expected)
    if img.mode in ("I;16", "F"):  # through a file as well (PNG keeps I;16, TIFF keeps F)
        buf = io.BytesIO()
        img.save(buf, "PNG" if img.mode == "I;16" else "TIFF")
        assert np.array_equal(load_image(buf.getvalue()).rgb, expected)


@pytest.mark.parametrize("mode", ["I;16", "F", "RGB"])
def test_decoding_a_large_picture_stays_within_its_lease(mode):
    """The lease a server takes before decoding (``decode_bytes``) covers the decode's peak: what
    tracemalloc sees (numpy's arrays and Python's bytes) plus Pillow's own buffer of the picture
    (allocated outside Python's allocator, so counted here from the mode's bytes per pixel).
    Before the 16-bit and float greys were scaled in strips, their whole-picture float64 copies
    alone peaked past the lease (3000x3000: 206 / 215 MiB traced against 155 / 172 MiB)."""
    n, rng = 3000, np.random.default_rng(0)
    if mode == "I;16":
        img, fmt, pillow_bpp = Image.fromarray(rng.integers(0, 65536, (n, n), dtype=np.uint16)), "PNG", 2
    elif mode == "F":
        img, fmt, pillow_bpp = Image.fromarray(rng.random((n, n), dtype=np.float32)), "TIFF", 4
    else:
        img, fmt, pillow_bpp = Image.fromarray(rng.integers(0, 256, (n, n, 3), dtype=np.uint8)), "PNG", 4
    buf = io.BytesIO()
    img.save(buf, fmt, **({"compress_level": 1} if fmt == "PNG" else {}))
    del img
    data = buf.getvalue()
    lease = decode_bytes(data)
    tracemalloc.start()
    try:
        out = load_image(data)
        _, traced = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.rgb.shape == (n, n, 3)
    peak = traced + n * n * pillow_bpp + len(data)  # (the body the lease counts too)
    assert peak <= lease, f"{mode}: decoding peaked at {peak / 2**20:.0f} MiB against a {lease / 2**20:.0f} MiB lease"
