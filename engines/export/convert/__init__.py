"""Checkpoint conversion for the TensorRT-LLM backend (``python convert_checkpoint.py``).

``llama`` maps the temporal transformer onto a TensorRT-LLM Llama checkpoint, ``native``
writes what runs beside the engine, ``onnx`` calls the Mimi / depformer exporters,
``readme`` writes the build commands, ``pipeline`` runs the resumable steps and ``cli`` is
the command line.  Nothing here imports TensorRT or TensorRT-LLM.
"""
