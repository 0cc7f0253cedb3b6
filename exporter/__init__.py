"""The PyTorch side: drafters (``exporter.speculative``), tracing, compare, bench and the CLIs."""
