"""The OpenAI-compatible server: request and reply mapping (``openai``), where pictures come
from (``media``), the worker thread that owns the scheduler (``worker``), and the ASGI app
(``app``: ``create_app``) that ``edgevlm serve`` runs on uvicorn."""
