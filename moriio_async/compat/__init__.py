"""Drop-in compatibility layers over the asyncio runtime.

- :mod:`moriio_async.compat.mori`: the names and signatures of MoRI-IO's
  ``mori.io`` (synchronous, safe from any thread), so code written against
  MoRI-IO ports by changing its imports.
- :mod:`moriio_async.compat.vllm`: the surface of vLLM's MoRIIO wrapper
  (``MoRIIOWrapper``, ``merge_contiguous_blocks``, ``kv_connector_extra_config``
  keys, ``TransferError`` lines), plus an async variant.

These layers sit above the engine and use only the package's public API.
"""
