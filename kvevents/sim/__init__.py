"""An engine simulator that emits vLLM-shaped KV events (drives the demo and tests)."""
