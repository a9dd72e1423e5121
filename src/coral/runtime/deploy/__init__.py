"""From a plan to running clusters: plan files, exports (SkyPilot, vLLM), advisory diffs, provisioners.

Nothing here imports torch at module level: `coral export` and `coral plan --running` run on a
laptop without the runtime extra.
"""
