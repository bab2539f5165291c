"""What only the tests use: the per-rank scenarios run on emulated ranks (CPU) and on GPUs, and the
float64 references they check against. Importable as ``support`` from tests/cpu and tests/gpu alike
(pytest puts ``tests`` on ``sys.path``: ``pythonpath`` in pyproject.toml); the ranks that
``tileweave.testing.emulated.run_ranks`` starts get the same ``sys.path``, so they import these
scenarios by name."""
