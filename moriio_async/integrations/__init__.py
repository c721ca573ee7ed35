"""Integrations: moriio_async under other projects' code, unchanged.

- :mod:`moriio_async.integrations.vllm`: the module vLLM loads with
  ``"kv_connector_module_path"``; vLLM's own MoRIIO connector runs on
  :mod:`moriio_async.compat.mori` (``pip install 'moriio-async[vllm]'``).

The helpers beside it (:mod:`.mori_alias`, :mod:`.cpu`, :mod:`.settings`) import
nothing of vLLM's, so they can be used and tested without it.
"""
