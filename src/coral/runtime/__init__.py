"""Serving runtime: ``engine/`` (layer-range models, KV cache, engine nodes, instance schedulers),
``serving/`` (coordinator, OpenAI-compatible API) and ``deploy/`` (cluster files, provisioners,
lifecycle, plan files), which talk only through the shared ``protocol`` and ``transport``.

Imports point one way: deploy -> serving, engine -> transport -> protocol.
"""
