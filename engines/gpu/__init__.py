"""GPU fast-path pieces (Triton kernels); every one has a PyTorch fallback used on CPU."""
