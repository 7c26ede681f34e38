"""The machinery that runs reward functions: the host bridge from jitted code
(host.py), the in-process runner with its watchdog (inprocess.py) and the
worker pool (pool.py)."""
