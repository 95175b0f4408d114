"""The runtime over a loaded model: the one sequence scheduler every caller submits to
(``scheduler``), prompts as KV items (``prompt``, ``items``, ``chat_format``), replies as text
(``textstream``), statistics (``stats``), the one-conversation engine (``engine``) and the
session policy that summarises old pictures when the context fills (``session``)."""
