"""Checkpoints, voices, the tokenizer, and the tiny and random models.

Importing this package imports no torch: the server's settings read ``hub``, ``random_weights`` and
``weights_format`` before any engine exists."""
