"""The asyncio layer: completion readers, transfers, the deadline wait, queue-pair channels (the data path)."""
