"""The request bodies of the OpenAI API as pydantic models (the OpenAPI schema is generated from them).

They mirror OpenAI's and vLLM's fields. As in vLLM's server, a field the models do not
know is ignored and logged (one line per request, its count and first few names), not refused (clients and gateways send fields of newer API
versions); a known field whose value the engine cannot honour (``best_of`` above ``n``,
beam search, tools, a ``response_format`` other than text, ``suffix``, ``echo`` with
``logprobs``) is refused with a 400 that names the field and the value
(:meth:`_Sampling.unsupported`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "IgnoredFields",
    "StreamOptions",
    "TextPart",
    "collect_ignored",
]

log = logging.getLogger(__name__)


class _Open(BaseModel):
    """Unknown fields are kept aside (``model_extra``) and logged, as vLLM's ``OpenAIBaseModel`` does."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored(self) -> _Open:
        if self.model_extra:
            sink = _IGNORED.get()
            if sink is None:
                log.warning("%s", IgnoredFields(self.model_extra).line())
            else:
                sink.add(self.model_extra)
        return self


#: Unknown field names a log line lists (the rest are counted), and the characters kept of each name.
LOGGED_FIELDS = 5
LOGGED_NAME_CHARS = 40


class IgnoredFields:
    """The unknown fields of one request body, counted, with the first few names kept for the log.

    A body of 600k unknown keys (or 1,000 messages with one each) logs one short line, never the
    whole list (log amplification).
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.count = 0
        self.first: list[str] = []
        self.add(names)

    def add(self, names: Iterable[str]) -> None:
        """Count more unknown field names."""
        for k in names:
            self.count += 1
            if len(self.first) < LOGGED_FIELDS:
                self.first.append(k if len(k) <= LOGGED_NAME_CHARS else k[:LOGGED_NAME_CHARS] + "...")

    def line(self) -> str:
        """The log line: the count and the first names."""
        more = f" and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        return f"{self.count} field(s) present in the request but ignored: {self.first}{more}"


_IGNORED: ContextVar[IgnoredFields | None] = ContextVar("coral_ignored_fields", default=None)


@contextmanager
def collect_ignored() -> Iterator[IgnoredFields]:
    """Within it, unknown fields of every model validated are counted into the one collector it yields
    (the caller logs it once per request) instead of each model logging its own line."""
    sink = IgnoredFields()
    token = _IGNORED.set(sink)
    try:
        yield sink
    finally:
        _IGNORED.reset(token)


class StreamOptions(_Open):
    """OpenAI's ``stream_options``."""

    include_usage: bool = Field(False, description="Send a last chunk with the token usage of the whole request.")
    continuous_usage_stats: bool = Field(False, description="Put the usage so far in every chunk (vLLM's extension).")


class _Sampling(_Open):
    model: str = Field(description="Name of a served model (see /v1/models).")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.")
    top_k: StrictInt | None = Field(None, ge=-1, description="Keep the k most likely tokens; 0 or -1 = all (vLLM's extension).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most likely one (vLLM's extension).")
    seed: StrictInt | None = Field(None, description="Sampling seed; same seed, same tokens.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted once from the logit of every token already generated.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per time it was generated.")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="Divides positive (multiplies negative) logits of tokens in the prompt or output (vLLM's extension).")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias added to its logit, -100 to 100.")
    stop: str | list[str] | None = Field(None, description="Up to 16 strings; generation ends before the first one (it is not returned).")
    stop_token_ids: list[StrictInt] | None = Field(None, description="Token ids that end generation, like EOS (vLLM's extension).")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text (vLLM's extension).")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens (vLLM's extension; for benchmarks).")
    min_tokens: StrictInt = Field(0, ge=0, description="Stop ids cannot end generation before this many tokens (vLLM's extension).")
    n: StrictInt = Field(1, ge=1, le=128, description="Choices to generate per prompt.")
    stream: bool = Field(False, description="Stream server-sent events as tokens are produced.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    user: str | None = Field(None, description="End-user id (logged nowhere; accepted for compatibility).")
    skip_special_tokens: bool = Field(True, description="Accepted (the byte tokenizer has no special tokens).")
    use_beam_search: bool = Field(False, description="Beam search (vLLM's extension): not supported, must be false.")

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling values with OpenAI's defaults filled in."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(0, self.top_k or 0),
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
        }

    def stops(self) -> list[str]:
        """The stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> tuple[str, Any, str] | None:
        """The first field whose value cannot be honoured: (field, value, why), else None."""
        if self.use_beam_search:
            return "use_beam_search", True, "beam search is not supported"
        if len(self.stops()) > 16:
            return "stop", len(self.stops()), "at most 16 stop strings"
        if any(s == "" for s in self.stops()):
            return "stop", "", "stop strings must not be empty"
        for k, v in (self.logit_bias or {}).items():
            if not k.lstrip("-").isdigit():
                return "logit_bias", k, "keys must be token ids"
            if not -100.0 <= v <= 100.0:
                return "logit_bias", v, "biases must be between -100 and 100"
        return None


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="Text (tokenized by the model's tokenizer), token ids, or a list of either (one choice set per prompt).")
    max_tokens: StrictInt | None = Field(16, ge=1, description="Most tokens to generate per choice; null = up to the context length.")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Return the sampled tokens' logprobs and this many alternatives.")
    echo: bool = Field(False, description="Prepend the prompt to the text.")
    best_of: StrictInt | None = Field(None, ge=1, description="Only best_of == n (or unset) is supported.")
    suffix: str | None = Field(None, description="Insertion suffix: not supported, must be unset.")

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (a single one, or each of a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> tuple[str, Any, str] | None:  # noqa: D102 - see _Sampling
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", self.best_of, "only best_of == n is supported"
        if self.suffix:
            return "suffix", self.suffix, "suffix is not supported"
        if self.echo and self.logprobs is not None:
            return "echo", True, "echo with logprobs (prompt logprobs) is not supported"
        return super().unsupported()


class TextPart(_Open):
    """A text part of a chat message's content."""

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ChatMessage(_Open):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author role.")
    content: str | list[TextPart] | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Author name (not part of the template).")

    @property
    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Open):
    """OpenAI's ``response_format``; only ``text`` is honoured."""

    type: str = Field(description="text, json_object or json_schema.")


class ChatRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: StrictInt | None = Field(None, ge=1, description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="Most tokens to generate per choice; default up to the context length.")
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Alternatives per token (needs logprobs).")
    add_generation_prompt: bool = Field(True, description="End the template with the assistant's header (vLLM's extension).")
    response_format: ResponseFormat | None = Field(None, description="Only {'type': 'text'} is supported.")
    tools: list[dict[str, Any]] | None = Field(None, description="Tool calling: not supported, must be empty.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none' (or 'auto' without tools).")
    parallel_tool_calls: bool | None = Field(None, description="Accepted (no tools are called).")

    def unsupported(self) -> tuple[str, Any, str] | None:  # noqa: D102 - see _Sampling
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", self.top_logprobs, "top_logprobs needs logprobs: true"
        if self.tools:
            return "tools", len(self.tools), "tool calling is not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", self.tool_choice, "tool calling is not supported"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", self.response_format.type, "only 'text' is supported"
        return super().unsupported()
