"""Models by name: the registry (names → hub files), the local hub cache (``store``), verified
downloads (``download``), plans from remote GGUF headers (``remote``) and the listing with a fit
verdict per model (``listing``)."""
