"""Plug-ins that let serving engines keep their KV caches in kvtool stores (``kvtool.integrations.vllm``)."""
