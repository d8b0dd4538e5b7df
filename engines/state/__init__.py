"""Per-slot state of a running engine: KV rings, the token ring, slots and their sampling settings."""
