"""The SentencePiece text tokenizer: persona prompts in, inner-monologue pieces out."""

from __future__ import annotations

from pathlib import Path

from engines.config import TEXT_EPAD_ID, TEXT_PAD_ID, TEXT_SPECIAL_LABELS
from engines.errors import CheckpointError

SYSTEM_TAG = "<system>"


def wrap_with_system_tags(text: str) -> str:
    """PersonaPlex wraps the persona in plain-text ``<system>`` tags unless already wrapped."""
    cleaned = text.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        import sentencepiece

        self.path = Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read the text tokenizer {self.path}: {exc}") from exc
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def persona_tokens(self, persona: str) -> list[int]:
        return self.encode(wrap_with_system_tags(persona))

    def piece(self, token: int) -> str:
        """Raw piece with "▁" as a space; "" for ids the tokenizer does not have."""
        if not 0 <= token < self.vocab_size:
            return ""
        return self._sp.id_to_piece(token).replace("\u2581", " ")

    def transcript_piece(self, token: int) -> str:
        """What a frame adds to the transcript: nothing for PAD / EPAD."""
        if token in (TEXT_EPAD_ID, TEXT_PAD_ID):
            return ""
        return self.piece(token)

    def label(self, token: int) -> str:
        """The offline CLI's per-frame label: 'PAD'/'EPAD' for padding, else the piece."""
        if token in (TEXT_EPAD_ID, TEXT_PAD_ID):
            return TEXT_SPECIAL_LABELS[token]
        return self.piece(token)
