"""Serving runtime: coordinator, router, instance schedulers, engine nodes and their wire protocol."""
