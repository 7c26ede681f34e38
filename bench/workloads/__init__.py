"""The benchmark workloads: one module each, run by bench/run.py."""
