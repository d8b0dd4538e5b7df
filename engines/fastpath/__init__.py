"""The GPU fast path, attached at the edge: Triton attention, CUDA graphs, the torch.compile policy."""
