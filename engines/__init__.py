"""Model engines for personaplex-serve, in levels (docs/ARCHITECTURE.md, "Files"): the
torch-free API at the top (``config``, ``interface``, ``errors``, ``progress``, ``audio_io``:
what the orchestrator imports), then ``model``, ``state``, ``runtime``, ``fastpath``,
``checkpoints``, ``export`` and ``tools``."""
