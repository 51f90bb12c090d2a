"""The ``remat`` command, its demo, and the benchmark helpers."""
