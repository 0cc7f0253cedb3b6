"""Graph passes of ``python -m exporter.optimize`` (one idea per module)."""
