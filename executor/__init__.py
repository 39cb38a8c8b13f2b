"""The executor: one process per GPU (TP rank) owning weights, KV pages and state slots."""
