"""Voice + persona prefill as a parallel causal pass, cached per (voice, persona).

Every stream is teacher-forced during the system prompt, so the temporal KV cache it leaves
behind is a deterministic function of (voice, persona).  The reference spends one model
call per prompt frame (100-200 calls); we replay the token bookkeeping without the model to
learn what each position's input is, embed all positions at once, run the temporal
transformer over the whole prompt (in chunks of positions when it is long, so that live
ticks can run between them), and keep the resulting keys/values.  Installing a cached
prefill into a slot is a copy.

Prompt phases (spec/model.md 4.3): the voice (replayed embeddings, N frames), 6 silence
frames, one frame per persona token, 6 silence frames.  Live audio starts at offset
P = N + 12 + T with P - 1 positions in the KV cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from engines.config import AUDIO_SILENCE_FRAMES, SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD_ID, LMConfig
from engines.model.lm import MoshiLM
from engines.interface import WAITING, Pieces, to_completion
from engines.state.prompt_kv import PromptKV
from engines.state.token_state import TokenState


@dataclass(frozen=True)
class VoicePrompt:
    """A voice as a prompt replays it (``engines.checkpoints.voices`` reads and builds them)."""

    name: str
    embeddings: torch.Tensor  # [N-1, D], one row per replayed model call
    cache: torch.Tensor  # [17, 4] int64 token ring after the voice frames

    @property
    def frames(self) -> int:
        """N: voice frames, including the first one whose call makes no model call."""
        return self.embeddings.shape[0] + 1


@dataclass(frozen=True)
class PromptFrame:
    """Tokens forced for one prompt frame: text, agent codebooks, user codebooks."""

    text: int
    agent: tuple[int, ...]
    user: tuple[int, ...]

    def streams(self) -> list[int]:
        return [self.text, *self.agent, *self.user]


def prompt_frames(persona_tokens: Sequence[int]) -> list[PromptFrame]:
    silence = PromptFrame(TEXT_PAD_ID, SILENCE_TOKENS, SINE_TOKENS)
    persona = [PromptFrame(int(t), SILENCE_TOKENS, SINE_TOKENS) for t in persona_tokens]
    return [silence] * AUDIO_SILENCE_FRAMES + persona + [silence] * AUDIO_SILENCE_FRAMES


def voice_replay_frame(cfg: LMConfig) -> PromptFrame:
    """The dummy tokens the reference forces while replaying voice embeddings."""
    init = cfg.audio_initial_id
    half = cfg.audio_codebooks
    return PromptFrame(TEXT_PAD_ID, (init,) * half, (init,) * half)


@dataclass(frozen=True)
class Prefill:
    """What a session's slot holds right after its system prompt."""

    keys: torch.Tensor  # [layers, heads, n, head_dim] of positions start..start+n-1
    values: torch.Tensor
    start: int
    token_cache: torch.Tensor  # [17, 4]
    token_provided: torch.Tensor  # [17, 4]
    offset: int  # P: the offset of the first live call

    @property
    def positions(self) -> int:
        return self.start + self.keys.shape[2]


def _frame_tensor(frame: PromptFrame, device: torch.device) -> torch.Tensor:
    return torch.tensor([frame.streams()], dtype=torch.long, device=device)


@dataclass(frozen=True)
class PromptPlan:
    """The token side of a system prompt: what the model is fed, and the slot state after.

    The model's input tokens come a range at a time (``rows``): a long persona's prefill asks
    for one piece's rows per piece, so no piece of a join does work in proportion to the
    whole prompt."""

    length: int  # model calls after the voice replay (one token row each)
    row_source: Callable[[int, int], torch.Tensor]  # (a, b) -> [b - a, 17] input tokens of calls a..b-1
    token_cache: torch.Tensor  # [17, 4]
    token_provided: torch.Tensor  # [17, 4]
    offset: int

    def rows(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The input token rows [end - start, 17] of calls ``start``..``end`` - 1 (all by default)."""
        end = self.length if end is None else min(end, self.length)
        start = min(max(start, 0), end)
        return self.row_source(start, end)


def plan_prompt_by_replay(cfg: LMConfig, voice: VoicePrompt | None, persona_tokens: Sequence[int]) -> PromptPlan:
    """Replay the prompt through ``TokenState`` frame by frame, as the reference loop does.

    The definition of the plan; hundreds of tiny tensor operations per prompt (tens of ms
    of host time), so serving uses ``plan_prompt`` and the tests hold the two equal.
    """
    return _replay(cfg, voice, persona_tokens, frames=None)


def _replay(cfg: LMConfig, voice: VoicePrompt | None, persona_tokens: Sequence[int],
            frames: int | None) -> PromptPlan:
    """Replay the whole prompt, or (``frames``) only its last ``frames`` frames from a
    blank slot whose offset is set to where they start."""
    device = torch.device("cpu")
    tokens = TokenState(cfg, 1, device=device)
    slot = torch.tensor([0])
    all_forced = torch.ones(1, cfg.num_streams, dtype=torch.bool, device=device)
    no_samples = (torch.zeros(1, dtype=torch.long, device=device),
                  torch.zeros(1, cfg.dep_q, dtype=torch.long, device=device))
    inputs: list[torch.Tensor] = []  # token rows of the positions after the voice

    def run_frame(frame: PromptFrame, record: bool) -> None:
        tokens.force(slot, _frame_tensor(frame, device), all_forced)
        if int(tokens.offset[0]) == 0:
            tokens.skip_call(slot)
            return
        model_input, _, _ = tokens.begin_call(slot)
        if record:
            inputs.append(model_input)
        # Every target entry is forced during the prompt, so no sample is ever stored.
        tokens.end_call(slot, *no_samples)

    if frames is not None:
        # The last ``frames`` frames of the prompt are those of its last ``frames`` tokens' prompt.
        voice_frames = voice.frames if voice is not None else 0
        tokens.offset[0] = voice_frames + len(persona_tokens) + 2 * AUDIO_SILENCE_FRAMES - frames
        prompt = prompt_frames(persona_tokens[-frames:])[-frames:]
    else:
        prompt = prompt_frames(persona_tokens)
        if voice is not None:
            dummy = voice_replay_frame(cfg)
            for _ in range(voice.frames):
                run_frame(dummy, record=False)
            tokens.cache[0] = voice.cache
    for frame in prompt:
        run_frame(frame, record=True)
    cache, provided, offset = tokens.snapshot(0)
    rows = torch.cat(inputs, dim=0) if inputs else torch.zeros(0, cfg.num_streams, dtype=torch.long)
    return PromptPlan(rows.shape[0], lambda a, b: rows[a:b], cache, provided, offset)


# Frames replayed for the final token state: the ring holds 4 positions and every stream is
# forced each frame, so the last few frames alone decide it (the tests check this).
_TAIL_FRAMES = 8


def plan_prompt(cfg: LMConfig, voice: VoicePrompt | None, persona_tokens: Sequence[int]) -> PromptPlan:
    """``plan_prompt_by_replay`` in closed form, each range of rows computed when asked for.

    During the prompt every stream is forced every frame, so the ring entry a call reads
    (position p = offset - 1 of stream k) was last written by one of: the start-of-stream
    rule (initial token, at p <= delay_k), the voice's saved ring (when the frame that
    wrote p, p - delay_k, belongs to the voice replay), or prompt frame p - delay_k.
    The rows are index arithmetic in numpy: torch's intra-op threads made the same few
    operations ~7x slower on a 2-core machine (265 ms against 40 for an 80,000-token persona).
    """
    pad = np.full(AUDIO_SILENCE_FRAMES, TEXT_PAD_ID, dtype=np.int64)
    text = np.concatenate([pad, np.asarray(persona_tokens, dtype=np.int64), pad])  # each prompt frame's text
    length = text.shape[0]  # prompt frames
    if length <= _TAIL_FRAMES:
        return plan_prompt_by_replay(cfg, voice, persona_tokens)
    voice_frames = voice.frames if voice is not None else 0
    first_call = max(voice_frames, 1)
    audio = np.array(PromptFrame(TEXT_PAD_ID, SILENCE_TOKENS, SINE_TOKENS).streams(), dtype=np.int64)
    delays = np.asarray(cfg.delays, dtype=np.int64).reshape(1, -1)
    initial = np.asarray(cfg.initial_tokens(), dtype=np.int64).reshape(1, -1)
    ring = voice.cache.to(torch.long).t().numpy() if voice is not None else None  # [ring, 17]

    def row_source(a: int, b: int) -> torch.Tensor:
        p = np.arange(first_call + a - 1, first_call + b - 1).reshape(-1, 1)  # [n, 1] positions read
        src = p - delays  # [n, 17] the frame whose force wrote p
        rows = np.broadcast_to(audio, src.shape).copy()  # every prompt frame's audio is the same
        rows[:, 0] = text[np.clip(src[:, 0] - voice_frames, 0, length - 1)]
        if ring is not None:
            saved = np.take_along_axis(ring, np.broadcast_to(p % ring.shape[0], src.shape), axis=0)
            rows = np.where(src < voice_frames, saved, rows)
        return torch.from_numpy(np.where((p >= voice_frames) & (p <= delays), initial, rows))

    tail = _replay(cfg, voice, persona_tokens, frames=_TAIL_FRAMES)
    return PromptPlan(voice_frames + length - first_call, row_source, tail.token_cache, tail.token_provided,
                      tail.offset)


def _voice_rows(voice: VoicePrompt | None) -> int:
    """Prompt positions of the voice's replayed embeddings (its first frame is no model call)."""
    return voice.embeddings.shape[0] if voice is not None else 0


def prompt_embeddings(lm: MoshiLM, voice: VoicePrompt | None, plan: PromptPlan, start: int = 0,
                      end: int | None = None) -> torch.Tensor:
    """The prompt's input embeddings [end - start, D] (all positions by default) on ``lm``'s
    device and dtype: the voice's stored embeddings replayed as they are, then the embedded
    token rows of the plan."""
    replayed = _voice_rows(voice)
    end = replayed + plan.length if end is None else end
    parts = []
    if voice is not None and start < replayed:
        parts.append(voice.embeddings[start:end].to(device=lm.device, dtype=lm.dtype))
    rows = plan.rows(max(0, start - replayed), max(0, end - replayed))
    if rows.shape[0]:
        parts.append(lm.embed_tokens(rows.to(lm.device).unsqueeze(0))[0])
    return torch.cat(parts, dim=0)


# Prompt positions per piece of a prefill that live ticks may run between.  At the 7B
# shapes a piece this long is well under a frame period of GPU time (docs/PERFORMANCE.md,
# "Joining prefill"), and a typical voice + persona (~170 positions) is one piece.
PREFILL_CHUNK = 256


def build_prefill(
    lm: MoshiLM,
    voice: VoicePrompt | None,
    persona_tokens: Sequence[int],
    window: str,
    capacity: int,
    chunk: int | None = None,
    graphs=None,
) -> Prefill:
    """The whole prefill of (``voice``, ``persona_tokens``) for a session window of
    ``capacity`` positions, computed at once (``prefill_pieces`` for the arguments)."""
    plan = plan_prompt(lm.cfg, voice, persona_tokens)
    return to_completion(prefill_pieces(lm, voice, plan, window, capacity, chunk, graphs))


def prefill_pieces(lm: MoshiLM, voice: VoicePrompt | None, plan: PromptPlan, window: str, capacity: int,
                   chunk: int | None = None, graphs=None, wait: bool = False) -> Pieces[Prefill]:
    """The device part of a prefill, one piece per ``next()``; the generator returns the
    ``Prefill``.  Each piece embeds its own positions (``prompt_pass``; ``graphs``: an
    ``engines.fastpath.prefill_graphs.PrefillGraphs``; ``wait``: see there)."""
    total = _voice_rows(voice) + plan.length

    def embed(start: int, end: int) -> torch.Tensor:
        return prompt_embeddings(lm, voice, plan, start, end)

    keys, values, first = yield from prompt_pass(lm, embed, total, window, capacity, chunk, graphs, wait)
    return Prefill(keys, values, first, plan.token_cache, plan.token_provided, plan.offset)


def prompt_pass(lm: MoshiLM, embed: Callable[[int, int], torch.Tensor], total: int, window: str, capacity: int,
                chunk: int | None = None, graphs=None,
                wait: bool = False) -> Pieces[tuple[torch.Tensor, torch.Tensor, int]]:
    """The causal pass over a prompt of ``total`` positions from an empty cache, ``chunk``
    positions per ``next()`` (all of them when None), each piece taking its input embeddings
    [n, D] from ``embed(start, end)``; returns the keys and values [layers, H, m, Dh] of the
    last m = min(total, ``capacity``) positions, and the first one's position.

    The pass keeps its state in a ``PromptKV`` of its own, so between pieces the caller may
    run live ticks on ``lm``: that is how a long prompt joins without pausing live sessions.
    Chunked or not, each query sees the keys one pass would show it.  A split prompt's last
    piece is padded to ``chunk`` (the padding comes after every real position, so causality
    keeps it out of them): every piece has one shape.  With ``graphs``, a prompt of one piece
    is replayed from its bucket's graph, and a split one from the piece graph (it has one
    cache).  While another pass holds that graph, a split pass with ``wait`` yields
    ``WAITING`` until it is free; without, it runs eagerly with a cache of its own (~1.7 GB at
    the 7B shapes: a burst of joins each holding one could exhaust the GPU's headroom).  Eager
    pieces are bound by the host launching their kernels whatever their length, replayed ones
    by the GPU (docs/PERFORMANCE.md, "Joins during a full load").
    """
    if chunk is None or chunk >= total:
        with torch.inference_mode():
            x = embed(0, total)
            replayed = graphs.run(x) if graphs is not None else None
        if replayed is not None:  # a bucket may be longer than the window: keep its newest positions
            keys, values = replayed
            first = max(0, total - capacity)
            return keys[:, :, first:].contiguous(), values[:, :, first:].contiguous(), first
        chunk, padded = total, total

        def embed(start: int, end: int) -> torch.Tensor:  # the one piece, embedded above
            return x
    else:
        padded = -(-total // chunk) * chunk
    cfg = lm.cfg
    pieces = graphs.claim_pieces(chunk) if graphs is not None and padded > chunk else None
    while pieces is None and wait and graphs is not None and padded > chunk and graphs.pieces_held(chunk):
        yield WAITING
        pieces = graphs.claim_pieces(chunk)
    try:
        with torch.inference_mode():
            if pieces is not None:
                kv, run = pieces.kv, pieces.run
            else:
                kv = PromptKV(cfg.num_layers, cfg.num_heads, cfg.head_dim, window=capacity,
                              size=PromptKV.size_for(capacity, padded, chunk), device=lm.device, dtype=lm.dtype)
                sequence = torch.zeros(1, dtype=torch.long, device=lm.device)

                def run(piece: torch.Tensor) -> None:
                    lm.temporal(sequence, piece, kv, window)
        for start in range(0, total, chunk):
            if start:
                yield  # outside inference mode: the caller's code runs in its own mode
            with torch.inference_mode():
                end = min(start + chunk, total)
                piece = torch.zeros(1, chunk, cfg.dim, device=lm.device, dtype=lm.dtype)
                piece[0, : end - start] = embed(start, end)
                run(piece)
        first = max(0, total - capacity)
        with torch.inference_mode():
            keys, values = kv.export(first, total)
        return keys, values, first
    finally:
        if pieces is not None:
            graphs.release_pieces(pieces)


def _nbytes(value) -> int:
    """Bytes of the tensors a cached value holds (a ``Prefill``, or the TensorRT-LLM
    backend's stored prompt)."""
    return sum(t.numel() * t.element_size() for t in vars(value).values() if isinstance(t, torch.Tensor))


class PrefillCache:
    """LRU of prefills keyed by (voice name, persona token ids); safe to share by threads.

    Bounded by entries and, given ``max_bytes``, by the bytes of their tensors: at the 7B
    shapes one prefill holds 0.5 MB per prompt position (up to 1.6 GB), all on the GPU
    beside the sessions' windows, so sixteen long personas alone would take the headroom
    the admission leaves.  A prefill larger than ``max_bytes`` is not kept.
    """

    def __init__(self, max_entries: int = 16, max_bytes: int | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, Prefill] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: tuple) -> Prefill | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: tuple, value: Prefill) -> None:
        size = _nbytes(value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            if self.max_bytes is not None and size > self.max_bytes:
                return
            self._entries[key] = value
            self._bytes += size
            while len(self._entries) > self.max_entries or (self.max_bytes is not None
                                                            and self._bytes > self.max_bytes):
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= _nbytes(evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)
