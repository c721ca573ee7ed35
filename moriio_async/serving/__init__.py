"""Disaggregated serving on moriio_async: a small model, prefill and decode servers, an OpenAI proxy.

Needs the ``serving`` extra (``pip install 'moriio-async[serving]'``). Run the
whole thing with ``python -m moriio_async.serving demo`` (``./scripts/demo``);
the pieces, one noun per module:

- ``model``: a numpy decoder-only transformer with a paged KV cache and a
  byte-level tokenizer; greedy generation in one process is the reference.
- ``kvpool``: the block pool of an instance (one registered buffer) and the
  merging of contiguous blocks into transfer segments.
- ``instance``, ``prefill``, ``decode``: the instance processes, each a FastAPI
  app owning one ``IOEngine``, in vLLM MoRIIO's READ and WRITE modes.
- ``proxy``, ``fleet``, ``api``: the OpenAI-compatible proxy (xPyD).
- ``messages``, ``rendezvous``, ``metrics``, ``web``, ``config``: control
  messages, prometheus metrics, HTTP plumbing, settings.
- ``launcher``, ``workload``, ``report``, ``demo``: the demo driver.

This package imports only ``moriio_async``'s public namespace.
"""
