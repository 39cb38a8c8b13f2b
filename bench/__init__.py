"""The parts of ``tidal bench`` (the command itself is ``tidal.bench.cli``): streamed requests and their
checks, the tap reader, percentile summaries and the plot."""
