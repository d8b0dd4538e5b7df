"""Client-side drivers for an online (websocket) deployment and their tests."""
