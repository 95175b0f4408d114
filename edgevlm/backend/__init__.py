"""The llama.cpp boundary: the only package that imports ``llama_cpp`` (and its ``mtmd``).

``llama``: a loaded model pair and the primitives the runtime builds on; ``system``: devices,
CPU features, the chat-template renderer and the log route, which need no loaded model;
``logs``: llama.cpp's log lines, captured and parsed; ``sampling``: the sampling options."""
