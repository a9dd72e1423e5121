"""Tokenizers of served models: a local ``tokenizer.json`` (Hugging Face ``tokenizers``) with its chat template.

Every tokenizer has the same small interface, which the HTTP front end calls:
``encode(text) -> list[int]``, ``decode(ids) -> str``, ``apply_chat_template(messages) -> str``
and :meth:`Tokenizer.stream` (an incremental decoder for streamed tokens). A model names its
tokenizer in the cluster file (``tokenizer: path/to/tokenizer.json`` or the folder holding it);
its chat template comes from ``chat_template`` there, else from ``tokenizer_config.json``
beside the tokenizer (as Hugging Face stores it), else the built-in one. Templates are Jinja,
rendered in a sandbox with ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``, like ``transformers``' ``apply_chat_template``.

A model without a tokenizer keeps :class:`ByteTokenizer` (token id = UTF-8 byte).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Protocol

from coral.errors import CoralError

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "ByteTokenizer",
    "HfTokenizer",
    "TextStream",
    "Tokenizer",
    "load_tokenizer",
]

#: The chat template of models that have none: ``<|role|>\ncontent\n`` per message, then ``<|assistant|>\n``.
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _content(m: Any) -> dict[str, str]:
    """A chat message (pydantic model or dict) as ``{"role", "content"}`` with text content."""
    role = m["role"] if isinstance(m, dict) else m.role
    content = m["content"] if isinstance(m, dict) else m.content
    if not isinstance(content, str):  # OpenAI content parts: keep the text ones
        texts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
        content = "".join(t for t in texts if t)
    return {"role": str(role), "content": content}


def _render(template: str, messages: list[Any], bos: str, eos: str) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)

    def raise_exception(msg: str) -> None:
        raise TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=[_content(m) for m in messages], add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except TemplateError as e:
        raise CoralError(f"chat template failed: {e}") from None


class TextStream(Protocol):
    """Turns a completion's streamed token ids into text pieces."""

    def step(self, ids: tuple[int, ...] | list[int], final: bool) -> str:
        """The new text after ``ids`` (the rest of it when ``final``)."""
        ...


class Tokenizer(Protocol):
    """What the front end needs from a model's tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (special tokens such as BOS added as the tokenizer defines)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens dropped)."""
        ...

    def apply_chat_template(self, messages: list[Any]) -> str:
        """The prompt text of a chat, ending with the assistant's turn."""
        ...

    def encode_chat(self, messages: list[Any]) -> list[int]:
        """Token ids of a chat prompt (the template's special tokens recognized, nothing added)."""
        ...

    def stream(self) -> TextStream:
        """A decoder for one streamed completion."""
        ...


class _Stream:
    """Incremental decoding: text is emitted once it no longer ends in a partial character."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted

    def step(self, ids: tuple[int, ...] | list[int], final: bool) -> str:
        """The new text after ``ids`` (all of it when ``final``)."""
        self.ids += list(ids)
        text = self.tok.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        out = text[self.sent :]
        self.sent = len(text)
        return out


class ByteTokenizer:
    """Deterministic byte-level tokenizer: token id = UTF-8 byte; decode renders ``id % 256``."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def apply_chat_template(messages: list[Any]) -> str:
        """The built-in chat template."""
        return _render(BUILTIN_CHAT_TEMPLATE, messages, "", "")

    def encode_chat(self, messages: list[Any]) -> list[int]:
        """Token ids of a chat prompt."""
        return self.encode(self.apply_chat_template(messages))

    def stream(self) -> _ByteStream:
        """A decoder for one streamed completion."""
        return _ByteStream()


class _ByteStream:
    def __init__(self) -> None:
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, ids: tuple[int, ...] | list[int], final: bool) -> str:
        return str(self.dec.decode(bytes(t % 256 for t in ids), final=final))


class HfTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """Args:
        path: ``tokenizer.json`` or the folder holding it.
        chat_template: Jinja template; default ``tokenizer_config.json``'s, else the built-in one.

        Raises:
            CoralError: if the file is missing or not a tokenizer.
        """
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

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's own special tokens, e.g. BOS)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens dropped)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: list[Any]) -> str:
        """The chat's prompt text (the template adds the special tokens it wants)."""
        return _render(self.chat_template, messages, self.bos_token, self.eos_token)

    def encode_chat(self, messages: list[Any]) -> list[int]:
        """Token ids of a chat prompt: the rendered template, nothing added."""
        return list(self._tok.encode(self.apply_chat_template(messages), add_special_tokens=False).ids)

    def stream(self) -> _Stream:
        """A decoder for one streamed completion."""
        return _Stream(self)


def _token_text(t: Any) -> str:
    if isinstance(t, dict):  # AddedToken serialized
        return str(t.get("content", ""))
    return "" if t is None else str(t)


def load_tokenizer(path: str | None, chat_template: str | None, model_vocab_size: int, model: str) -> Tokenizer:
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
    tok: Tokenizer = ByteTokenizer() if path is None else HfTokenizer(path, chat_template)
    if chat_template and path is None:
        raise CoralError(f"model {model!r}: chat_template needs a tokenizer (set tokenizer: path/to/tokenizer.json)")
    if tok.vocab_size > model_vocab_size:
        raise CoralError(f"model {model!r}: its tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {model_vocab_size}")
    return tok
