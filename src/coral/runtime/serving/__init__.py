"""The OpenAI-compatible front end: ASGI app (FastAPI on uvicorn), request models, metrics, tokenizer seam."""

from coral.runtime.serving.app import ApiServer, ServerOptions, build_app
from coral.runtime.serving.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ApiServer", "ByteTokenizer", "ServerOptions", "Tokenizer", "build_app"]
