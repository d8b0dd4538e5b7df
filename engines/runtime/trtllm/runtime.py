"""Executes ``EngineCall``s on a TensorRT-LLM 1.2.1 Llama engine (needs a GPU and TensorRT-LLM).

We drive the serialized engine with ``tensorrt_llm.runtime.Session`` (deserialize, set input
shapes, bind addresses, ``execute_async_v3``) and bind every attention-plugin input
ourselves, as ``GenerationSession`` does for a paged-KV, remove-input-padding build
(spec/trtllm.md 3.2 A): ``GenerationSession`` samples internally and batches statically, so it
cannot run a lockstep of independent, never-ending sessions.  The KV pool is ours: one
tensor ``[blocks, layers, 2, heads, tokens_per_block, head_dim]`` whose blocks are handed to
slots once (``kv_blocks.SlotKVBlocks``).

What a call binds is ``EngineBindings``, which needs no TensorRT: the CPU tests execute its
inputs on a model of the engine.  ``TrtllmExecutor`` is written against the documented 1.2.1
API and has not run here (no TensorRT-LLM on CPU machines, docs/TRTLLM.md).  On the first
call it checks the engine's inputs and their dtypes against what it binds and fails with the
differences rather than guessing.
"""

from __future__ import annotations

import json
import logging

import torch

from engines.runtime.trtllm.guard import BackendUnavailable, require_tensorrt, require_tensorrt_llm
from engines.runtime.trtllm.layout import BuildLayout, BuildMeta
from engines.runtime.trtllm.prompt_table import EngineCall
from engines.runtime.trtllm.kv_blocks import blocks_per_slot
from engines.runtime.trtllm.staging import Fence, InputStaging

log = logging.getLogger(__name__)

ENGINE_FILE = "rank0.engine"
MULTI_BLOCK_MODE = 0  # index of host_runtime_perf_knobs (GenerationSession's layout)
# Bound only when the engine declares them (rotary models may take positions from the
# sequence lengths instead).
OPTIONAL_INPUTS = frozenset({"position_ids"})


def read_engine_config(layout: BuildLayout) -> dict:
    path = layout.engine_dir / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(f"cannot read the engine config {path}: {exc}") from exc


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.int8: torch.int8, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if dtype not in table:
        raise BackendUnavailable(f"unexpected engine tensor dtype {dtype}")
    return table[dtype]


def staged_values(call: EngineCall, block_offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-call host values of ``call`` by the input they are staged as (``staging``)."""
    return {
        "input_ids": call.input_ids, "position_ids": call.position_ids, "tasks": call.tasks,
        "last_token_ids": call.last_token_ids, "context_lengths": call.context_lengths,
        "sequence_length": call.sequence_length, "prompt_vocab_size": call.prompt_vocab_size,
        "kv_cache_block_offsets": block_offsets, "host_request_types": call.request_types,
        "host_past_key_value_lengths": call.past_key_value_lengths,
    }


class EngineBindings:
    """What an engine call binds, for a KV ``pool`` on the engine's device: the per-call
    inputs through ``InputStaging``, the rest made once here.  Needs no TensorRT, so the
    CPU tests build these very inputs and execute them on a model of the engine
    (tests/trtllm_reference.py); ``TrtllmExecutor`` adds the engine itself."""

    def __init__(self, meta: BuildMeta, num_slots: int, window: int, tokens_per_block: int, pool: torch.Tensor,
                 fence: Fence | None = None) -> None:
        self.meta = meta
        self.window = window
        self.tokens_per_block = tokens_per_block
        self.device = pool.device
        self.pool = pool
        layers = meta.num_layers
        # A context call carries at most a window of positions (longer prompts continue as
        # generation calls: temporal.TemporalRunner.prefill), a decode call one per slot.
        max_tokens = max(min(meta.max_prefill, window), num_slots)
        self.staging = InputStaging(max_tokens, num_slots, blocks_per_slot(window, tokens_per_block), self.device,
                                    fence)
        # Host-side plugin inputs that never change.
        self.static_host = {
            "host_kv_cache_pool_pointers": torch.tensor([[pool.data_ptr(), 0]], dtype=torch.int64),
            "host_kv_cache_pool_mapping": torch.tensor([[0, layer] for layer in range(layers)], dtype=torch.int32),
            "host_max_attention_window_sizes": torch.full((layers,), window, dtype=torch.int32),
            "host_sink_token_length": torch.zeros(1, dtype=torch.int32),
            "host_runtime_perf_knobs": torch.full((16,), -1, dtype=torch.int64),
            "host_context_progress": torch.zeros(1, dtype=torch.int64),
        }
        self.static_host["host_runtime_perf_knobs"][MULTI_BLOCK_MODE] = 1
        # Beam width 1: the indirection is all zeros; one row per sequence of a call.
        self.cache_indirection = torch.zeros((num_slots, 1, window), dtype=torch.int32, device=self.device)

    def _bindings(self, call: EngineCall, block_offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every input of ``call`` by engine input name.  Allocates nothing when the table is
        already on the device in the engine's dtype (as the tick's is): the per-call values
        go through the staging buffers, one copy in all."""
        if call.num_tokens > self.window and call.is_context:  # is_context costs a reduction: only when it matters
            raise ValueError(f"a {call.num_tokens}-position context is longer than the attention window "
                             f"{self.window}: not supported by this runtime")
        staged = self.staging.stage(staged_values(call, block_offsets), call.num_tokens, call.batch)
        table = call.table.to(device=self.device, dtype=getattr(torch, self.meta.dtype)).contiguous()
        return {
            **staged,
            "cache_indirection": self.cache_indirection[: call.batch],
            "prompt_embedding_table": table,
            **self.static_host,
        }


class TrtllmExecutor(EngineBindings):
    def __init__(self, layout: BuildLayout, meta: BuildMeta, num_slots: int, window: int, device: str = "cuda") -> None:
        session_cls = require_tensorrt_llm("tensorrt_llm.runtime").Session
        self.trt = require_tensorrt()
        dev = torch.device(device)
        if dev.type != "cuda":
            raise BackendUnavailable(f"the TensorRT-LLM backend runs on a CUDA device, not {device!r}")
        config = read_engine_config(layout)
        build = config.get("build_config", {})
        plugin = build.get("plugin_config", {})
        tokens_per_block = int(plugin.get("tokens_per_block", meta.tokens_per_block))
        self._check_build(build, meta, num_slots)
        engine_path = layout.engine_dir / ENGINE_FILE
        log.info("loading the TensorRT-LLM engine %s", engine_path)
        self.session = session_cls.from_serialized_engine(engine_path.read_bytes())
        engine = self.session.engine
        self.io = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        layers, heads = meta.num_layers, meta.num_heads
        head_dim = meta.hidden_size // heads
        kv_dtype = torch.uint8 if meta.kv_cache_dtype == "fp8" else getattr(torch, meta.dtype)
        pool_shape = (num_slots * blocks_per_slot(window, tokens_per_block), layers, 2, heads, tokens_per_block,
                      head_dim)
        pool = torch.empty(pool_shape, dtype=kv_dtype, device=dev)
        log.info("KV pool: %s %s (%.2f GiB)", tuple(pool_shape), kv_dtype, pool.numel() * pool.element_size() / 2**30)
        super().__init__(meta, num_slots, window, tokens_per_block, pool)
        self.logits = torch.empty((num_slots, meta.vocab_size), dtype=torch.float32, device=dev)
        self._inflight: dict[str, torch.Tensor] = {}
        self._checked = False

    @staticmethod
    def _check_build(build: dict, meta: BuildMeta, num_slots: int) -> None:
        need = {"max_batch_size": num_slots, "max_prompt_embedding_table_size": meta.prompt_table_size}
        short = {k: (build.get(k), v) for k, v in need.items() if build.get(k) is not None and build[k] < v}
        if short:
            raise BackendUnavailable("the engine was built too small: " + ", ".join(
                f"{k}={have} < {want}" for k, (have, want) in short.items()) + "; rebuild with the README's command")

    def _check_io(self, inputs: dict[str, torch.Tensor]) -> None:
        """Once: every engine input is bound, with the engine's dtype."""
        engine, trt = self.session.engine, self.trt
        wanted = {n for n in self.io if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        problems = [f"unbound input {n}" for n in sorted(wanted - set(inputs))]
        problems += [f"input {n} is not an engine input" for n in sorted(set(inputs) - wanted - OPTIONAL_INPUTS)]
        for name in sorted(wanted & set(inputs)):
            want = _torch_dtype(trt, engine.get_tensor_dtype(name))
            if want != inputs[name].dtype and not (name == "prompt_embedding_table" and want.is_floating_point):
                problems.append(f"{name}: engine wants {want}, bound {inputs[name].dtype}")
        if "logits" not in self.io:
            problems.append("the engine has no 'logits' output")
        if problems:
            raise BackendUnavailable("the engine's inputs differ from what this runtime binds: " + "; ".join(problems))
        self._checked = True

    def run(self, call: EngineCall, block_offsets: torch.Tensor) -> torch.Tensor:
        inputs = self._bindings(call, block_offsets)
        if not self._checked:
            self._check_io(inputs)
        inputs = {k: v for k, v in inputs.items() if k in self.io}
        context = self.session.context
        for name, tensor in inputs.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"the engine rejects shape {tuple(tensor.shape)} for {name}")
        logits = self.logits[: call.batch]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if not self.session.run(inputs, {"logits": logits}, stream):
            raise RuntimeError("TensorRT-LLM engine execution failed")
        # The next call rewrites the staging host buffer only once the device is past this
        # call, whose host inputs (host_*) are views of that buffer (InputStaging.stage).
        self.staging.fence.record()
        # A table converted for this call must outlive its asynchronous execution: keep the
        # inputs until the next call.
        self._inflight = inputs
        return logits
