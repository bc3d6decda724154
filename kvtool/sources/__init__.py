"""Where KV caches come from.

Safetensors dumps (kvtool's own and other tools') load with ``KVCache.load``;
``kvtool.sources.hf`` runs a Hugging Face causal LM over a text and returns its
cache (needs the ``model`` extra). Importing this package imports no torch.
"""
