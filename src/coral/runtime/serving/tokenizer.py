"""The one seam between the front end and a tokenizer: encode, decode, stream-decode, chat template.

The front end only talks to :class:`Tokenizer`. Until a model ships its own tokenizer the
runtime uses :class:`ByteTokenizer`: a string's UTF-8 bytes are its token ids (0-255) and a
generated id renders as the byte ``id % 256``. A real tokenizer (e.g. one built on HF
``tokenizers`` from a local ``tokenizer.json``) drops in by implementing the same four
methods and being passed to :class:`coral.runtime.serving.ApiServer` per model.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

__all__ = ["ByteTokenizer", "ChatTurn", "StreamDecoder", "Tokenizer"]


class ChatTurn(Protocol):
    """What a chat template needs of a message."""

    role: str

    @property
    def text(self) -> str:
        """The message's text content."""
        ...


class StreamDecoder(Protocol):
    """Turns generated ids into text piece by piece (a multi-byte character waits for its last id)."""

    def push(self, ids: Sequence[int]) -> str:
        """The text completed by ``ids``."""
        ...

    def flush(self) -> str:
        """Whatever is left at the end of the stream."""
        ...


class Tokenizer(Protocol):
    """What the front end needs of a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        ...

    def stream(self) -> StreamDecoder:
        """A fresh incremental decoder."""
        ...

    def token_text(self, token: int) -> str:
        """The text of one token on its own (logprobs' ``token`` fields)."""
        ...

    def chat_prompt(self, messages: Sequence[ChatTurn], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``."""
        ...


class _ByteStream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._dec.decode(bytes(i % 256 for i in ids))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """Deterministic byte-level tokenizer: token id = UTF-8 byte; decode renders ``id % 256``."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        """An incremental UTF-8 decoder."""
        return _ByteStream()

    def token_text(self, token: int) -> str:
        """The byte of ``token`` as text (a lone non-ASCII byte becomes U+FFFD)."""
        return self.decode([token])

    def chat_prompt(self, messages: Sequence[ChatTurn], add_generation_prompt: bool = True) -> str:
        """The built-in chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
        parts = [f"<|{m.role}|>\n{m.text}\n" for m in messages]
        return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")
