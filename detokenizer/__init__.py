"""Incremental detokenization, stop strings and text deltas."""
