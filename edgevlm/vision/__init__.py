"""Pictures before the encoder: safe loading into RGB (``images``), detail scores (``detail``),
budgets, resizing and tiles (``budget``), and visual token merging after the projector
(``merge``)."""
