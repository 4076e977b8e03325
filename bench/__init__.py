"""Benchmarks: one module per scenario with ``main(argv)``; results are JSON under
``bench/results/`` and tables in ``docs/benchmarks.md`` (``python -m bench report``)."""
