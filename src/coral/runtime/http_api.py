"""The OpenAI-compatible HTTP front end (kept as an import path; the code is :mod:`coral.runtime.serving`)."""

from coral.runtime.serving.app import ApiServer, ServerOptions, build_app
from coral.runtime.serving.models import ChatMessage, ChatRequest, CompletionRequest
from coral.runtime.serving.tokenizer import ByteTokenizer

__all__ = ["ApiServer", "ByteTokenizer", "ChatMessage", "ChatRequest", "CompletionRequest", "ServerOptions", "build_app"]
