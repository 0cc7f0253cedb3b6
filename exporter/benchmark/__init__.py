"""The benchmark behind ``python -m exporter.bench``: our runtime against what users run instead.

    run.py       one run: BenchOptions, the systems prepared, measured interleaved, the report
    variants.py  ``--variants``: raw/fused/int8/int4 copies of one export side by side
    prompts.py   the prompts (read by exporter.prompts; chat messages through the export's template)
    systems.py   what is measured: our runtime (mode, tree, precision) and the peers, each in its own
                 worker subprocess driven one prompt at a time, interleaved
    worker.py    the worker process (stdlib + numpy at import; each runner imports its own stack)
    report.py    aggregation per system, greedy-equality checks, memory-bandwidth fraction, JSON, PNG
"""
