"""The serving side of the runtime: the coordinator (registry, router, token streams), the
OpenAI-compatible front end (``app``: FastAPI on uvicorn; ``models``, ``metrics``, ``tokenizer``)
and ``coral bench`` (``loadgen``).

Nothing is imported here: ``coral bench`` and the coordinator load without FastAPI.
"""
