"""Incremental detokenization with stop strings: text deltas that never split a UTF-8 character.

`tokenizers`' DecodeStream buffers byte tokens until they form whole characters. Stop strings can span
tokens, so the last `longest stop - 1` characters are held back until they cannot start a match.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalText:
    """Turns one generation's tokens into text deltas; `stopped` once a stop string matched."""

    __slots__ = ("_held", "_hold", "_ids", "_produced", "_skip", "_stops", "_stream", "_tokenizer", "stopped")

    def __init__(self, tokenizer: Tokenizer, stops: list[str], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._ids: list[int] = []
        self._produced = 0  # characters the stream has produced
        self._held = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        piece = self._stream.step(self._tokenizer, token_id)
        if piece:
            self._produced += len(piece)
            self._held += piece
        return self._release(final=False)

    def flush(self) -> str:
        """At the end: what is held, plus bytes the stream still buffers (an incomplete character is U+FFFD)."""
        if self.stopped:
            return ""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        self._held += full[self._produced :]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        matches = [at for stop in self._stops if (at := self._held.find(stop)) >= 0]
        if matches:
            self.stopped = True
            out, self._held = self._held[: min(matches)], ""
            return out
        cut = len(self._held) - (0 if final else self._hold)
        if cut <= 0:
            return ""
        out, self._held = self._held[:cut], self._held[cut:]
        return out
