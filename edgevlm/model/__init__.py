"""What the GGUF files say, before anything is loaded: metadata and tensor tables
(``gguf_info``), the projector-facts table and image-token arithmetic (``projectors``), KV-cache
types (``kv_types``) and the ``inspect`` report."""
