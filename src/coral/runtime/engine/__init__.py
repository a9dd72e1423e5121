"""The engine side of the runtime: the engine node process, its KV-cache manager and batched forward passes."""

from coral.runtime.engine.node import EngineNode, NoopShard

__all__ = ["EngineNode", "NoopShard"]
