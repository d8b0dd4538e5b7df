"""Model engines for personaplex-serve: checkpoint loading, the batched streaming model,
prefill, sampling and the offline CLI.  The orchestrator talks to it only through
``engines.interface``."""
