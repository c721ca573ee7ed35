"""The runtime's logic with no asyncio and no I/O: planning, send-queue accounting, outcomes, framing."""
