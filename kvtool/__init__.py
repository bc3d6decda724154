"""kvtool: keep LLM KV caches instead of recomputing them.

Importing kvtool loads no optional library (torch, redis, vllm, QATzip); each
is imported when the component that needs it is first used.
"""

__version__ = "0.1.0"
