"""End-to-end tools and tests that drive a running server over its public protocol."""
