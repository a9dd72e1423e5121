"""The one seam between the front end and a tokenizer: encode, decode, stream-decode, chat template.

The front end only talks to :class:`Tokenizer`, one per model, passed to
:class:`coral.runtime.serving.ApiServer` (``tokenizers={model: ...}``). Two implementations:

- :class:`HfTokenizer`: a Hugging Face ``tokenizers`` tokenizer from a local
  ``tokenizer.json`` (the model's ``tokenizer`` in the cluster file). Its chat template is
  the model's ``chat_template`` there, else ``chat_template`` from ``tokenizer_config.json``
  beside the tokenizer (as Hugging Face stores it), else the built-in one. Templates are
  Jinja, rendered in a sandbox with ``messages``, ``add_generation_prompt``, ``bos_token``
  and ``eos_token``, like ``transformers``' ``apply_chat_template``.
- :class:`ByteTokenizer` (a model without a tokenizer): a string's UTF-8 bytes are its token
  ids (0-255) and a generated id renders as the byte ``id % 256``.

:func:`load_tokenizer` picks one for a model and checks it fits the model's vocabulary.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from coral.errors import CoralError

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "ByteTokenizer",
    "ChatTurn",
    "HfTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "load_tokenizer",
]

#: The chat template of models that have none: ``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n``.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the tokenizer's own (e.g. BOS).

        A completion prompt is encoded with them; a rendered chat prompt without (its
        template writes the special tokens it wants).
        """
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

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes; there are no special tokens)."""
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


def _message(m: Any) -> dict[str, str]:
    """A chat message (a :class:`ChatTurn` or a dict) as the template sees it: ``{"role", "content"}``."""
    if isinstance(m, dict):
        content = m.get("content")
        if content is None:
            content = ""
        elif not isinstance(content, str):  # OpenAI content parts: keep the text ones
            content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
        return {"role": str(m["role"]), "content": content}
    return {"role": str(m.role), "content": m.text}


def _render(template: str, messages: Sequence[Any], add_generation_prompt: bool, bos: str, eos: str) -> str:
    # lazy: jinja2 (only with a chat template)
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

    def raise_exception(msg: str) -> None:
        raise TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[_message(m) for m in messages], add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
        )  # fmt: skip
    except TemplateError as e:
        raise CoralError(f"chat template failed: {e}") from None


class _HfStream:
    """Incremental decoding: text is emitted once it no longer ends in a partial character."""

    def __init__(self, tok: HfTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted

    def push(self, ids: Sequence[int]) -> str:
        self.ids += list(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        out = text[self.sent :]
        self.sent = len(text)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        out = text[self.sent :]
        self.sent = len(text)
        return out


class HfTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """Args:
        path: ``tokenizer.json`` or the folder holding it.
        chat_template: Jinja template; default ``tokenizer_config.json``'s, else the built-in one.

        Raises:
            CoralError: if the file is missing or not a tokenizer.
        """
        # lazy: tokenizers (only with a tokenizer.json)
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise CoralError(f"no tokenizer.json at {path}")
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise CoralError(f"{file} is not a tokenizers file: {e}") from None
        cfg: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise CoralError(f"{cfg_file}: not JSON: {e}") from None
        self.chat_template = chat_template or cfg.get("chat_template") or BUILTIN_CHAT_TEMPLATE
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.path = str(file)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The id of ``tokenizer_config.json``'s eos token, if it has one."""
        i = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        return () if i is None else (int(i),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special tokens, e.g. BOS, if asked)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (special tokens dropped)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> StreamDecoder:
        """A decoder for one streamed completion (holds back a partial character)."""
        return _HfStream(self)

    def token_text(self, token: int) -> str:
        """The text of one token on its own."""
        return str(self._tok.decode([token], skip_special_tokens=False))

    def chat_prompt(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
        """The chat's prompt text (the template writes the special tokens it wants)."""
        return _render(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token)


def _token_text(t: Any) -> str:
    if isinstance(t, dict):  # AddedToken serialized
        return str(t.get("content", ""))
    return "" if t is None else str(t)


def load_tokenizer(path: str | None, chat_template: str | None, model_vocab_size: int, model: str) -> HfTokenizer | ByteTokenizer:
    """A model's tokenizer: :class:`HfTokenizer` from ``path``, else :class:`ByteTokenizer`.

    Args:
        path: ``tokenizer.json`` or its folder; None for the byte tokenizer.
        chat_template: overrides the tokenizer's template.
        model_vocab_size: the model's vocabulary (the tokenizer's must fit in it).
        model: the model's name, for errors.

    Returns:
        The tokenizer.

    Raises:
        CoralError: if the tokenizer cannot be loaded or has more tokens than the model.
    """
    if chat_template and path is None:
        raise CoralError(f"model {model!r}: chat_template needs a tokenizer (set tokenizer: path/to/tokenizer.json)")
    tok: HfTokenizer | ByteTokenizer = ByteTokenizer() if path is None else HfTokenizer(path, chat_template)
    if tok.vocab_size > model_vocab_size:
        raise CoralError(f"model {model!r}: its tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {model_vocab_size}")
    return tok
