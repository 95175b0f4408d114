"""Token arithmetic per projector family, one module each, named in the projector-facts table
(``model.projectors``). A module exports ``image_tokens(proj, width, height, min_tokens=None,
max_tokens=None) -> ImageTokens``: mtmd's own preprocessing (``tools/mtmd/mtmd-image.cpp``,
``clip.cpp``) mirrored in Python so the count is known before the encoder runs; the tests compare
it with mtmd's chunks for every generated family."""
