"""The commented starter scenario `coral scenario init` writes (and docs/scenarios.md shows)."""
from __future__ import annotations

STARTER_YAML = """\
# A Coral scenario: which models to serve under which SLOs, what traffic they get, and which
# GPU nodes may be rented where. Check it with `coral scenario show THIS_FILE`; every field is
# listed in docs/scenarios.md. Built-in starting points: `coral scenario list`.
name: my-scenario
description: "One model on L4 / L40S nodes in one AWS region"

models:
  - name: qwen3-32b            # reported under this name; a built-in spec (`coral catalog models`)
    # spec: path/to/config.json  # or your own Hugging Face config.json (relative to this file)
    ttft_ms: 5000              # time-to-first-token SLO, ms: half of it is the prefill budget of
                               # the long prompts; `coral plan` says when a value is out of reach
    tpot_ms: 100               # time-per-output-token SLO, ms
    workload:
      rate_per_s: 4            # mean requests per second
      dataset: synthetic-azure-conv   # lognormal lengths fitted to Azure's trace: needs no data;
                                      # azure-code / azure-conv / burstgpt replay the real traces

configs: [1xL4, 4xL4, 1xL40S, 4xL40S]   # node shapes that may be rented (`coral catalog configs`)

regions:
  - name: aws:us-east-2        # `coral catalog prices` lists what each region sells
    # prices: {1xL4: 0.70}     # $/h overrides of the built-in prices
    # availability: {4xL40S: 2}  # nodes you can get, per shape (others: default_availability)

default_availability: 64       # nodes available per (region, shape) unless listed

planner:
  n_max: 4                     # most nodes in one serving template (the library grows fast with it)
"""
