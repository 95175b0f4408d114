"""Every odd image a user has loads as RGB, or fails with one clear line."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from edgevlm.errors import ImageError
from edgevlm.vision.images import load_image


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
