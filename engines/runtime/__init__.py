"""One engine over a temporal backend (PyTorch or TensorRT-LLM), and the factory that builds it."""
