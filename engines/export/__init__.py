"""Converted forms of a checkpoint: TensorRT-LLM builds and fp8 copies (``convert``), ONNX graphs."""
