"""The serving demo with real vLLM servers (``./scripts/demo --engine vllm``).

vLLM runs in a venv of its own (:mod:`.venv`); these modules run in the
project's environment and import nothing of vLLM's: :mod:`.servers` starts and
stops vLLM's OpenAI servers, :mod:`.proxy` fronts a prefill/decode pair with
vLLM's MoRIIO proxy convention, :mod:`.demo` runs and checks the load,
:mod:`.kvtrace` reads the KV transfer figures, and :mod:`.tinymodel` (run in
the vLLM venv) makes the model.
"""
