"""Turning a token stream into text: incremental detokenization and stop strings.

Both are per-request state machines with no I/O, used by the postfilter worker and tested
on their own.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Incremental detokenization that never emits half of a multi-byte UTF-8 character.

    Wraps ``tokenizers``' ``DecodeStream``, which buffers tokens until they decode to whole
    characters (byte-level BPE splits emoji and CJK characters across tokens).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (``fast_tokenizer.backend_tokenizer``).
        skip_special_tokens: leave special tokens (chat-template markers, EOS) out of the text.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.num_chars = 0

    def step(self, token_id: int) -> str:
        """Text completed by one more token ('' while a character is still incomplete)."""
        self.token_ids.append(token_id)
        text = self._stream.step(self._tokenizer, token_id) or ""
        self.num_chars += len(text)
        return text

    def finish(self) -> str:
        """At the end of the stream: whatever the whole output decodes to beyond what
        :meth:`step` released — bytes of a character the output never completed come out
        as U+FFFD, exactly as a one-shot ``decode`` of all the tokens gives them."""
        full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special)
        rest = full[self.num_chars :]
        self.num_chars = len(full)
        return rest


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries, without leaking them.

    The request stops at the stop string that completes first in the text (as if the text
    were checked after every character), cut where that string starts. Text that could be
    the start of a stop string is held back until it either completes a stop string (then it is dropped, or kept with ``include_stop``) or can no longer be one
    (then it is released). So the emitted text never contains a stop string, or any part of
    one that then completed.

    Args:
        stops: stop strings (empty strings are ignored).
        include_stop: emit the matched stop string itself (vLLM's
            ``include_stop_str_in_output``).
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, whether a stop string was matched)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        # the stop string that completes first (smallest end), earliest start on a tie
        first: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (first is None or (at + len(stop), at) < first[:2]):
                first = (at + len(stop), at, stop)
        if first is not None:
            _, at, stop = first
            self.held = ""
            self.stopped = True
            return buf[:at] + (stop if self.include_stop else ""), True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held text at the end of the stream (no stop string completed)."""
        out, self.held = self.held, ""
        return out


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE
    (Radford et al., 2019): printable Latin-1 bytes map to themselves, the other 68 bytes to
    the code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """A token's own text and raw bytes, for logprobs (cached per id).

    Byte-level BPE vocabularies spell bytes as printable characters; SentencePiece ones use
    ``▁`` for a space and ``<0xNN>`` for byte-fallback tokens. Anything else falls back to
    decoding the token alone.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(tokenizer, "decoder", None)
        self._byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        self._bytes_of = _byte_level_decoder() if self._byte_level else {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._tokenizer.id_to_token(token_id) or ""
        raw: bytes | None = None
        if self._byte_level and piece and all(c in self._bytes_of for c in piece):
            raw = bytes(self._bytes_of[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])
        elif "\u2581" in piece:
            raw = piece.replace("\u2581", " ").encode()
        if raw is None:
            raw = self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        text = raw.decode("utf-8", errors="replace")
        self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]
