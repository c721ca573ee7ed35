"""Drop-in compatibility layer over the asyncio runtime.

- :mod:`moriio_async.compat.mori`: the names and signatures of MoRI-IO's
  ``mori.io`` (synchronous, safe from any thread), so code written against
  MoRI-IO ports by changing its imports.

vLLM's own MoRIIO connector runs on ``compat.mori`` through
:mod:`moriio_async.integrations.vllm`.

This layer sits above the engine and uses only the package's public API.
"""
