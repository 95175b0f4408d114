"""Vision-encoder compute graphs beyond the built-in ones (``plan.clipgraph``: LLaVA's CLIP and the
Qwen2/2.5-VL ViTs), one module per graph named in the projector-facts table's ``encoder_graph``.
A module exports ``compute_bytes(proj, n_patches, flash_attn, grid=None) -> int``: the clip
compute buffer for one chunk of ``n_patches`` patches, replayed node by node through
``plan.graphalloc`` as mtmd builds the graph (``tools/mtmd/models/*.cpp``). ``grid`` is the
chunk's token grid (``View.nx``, ``View.ny``) when known: Pixtral's buffer depends on its rows;
without it a graph takes the worst grid for the patch count (never under)."""
