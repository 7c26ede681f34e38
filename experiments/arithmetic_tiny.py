"""The embedded default experiment (a tiny decoder learns addition from scratch).

It lives in the package, grpojax/default_experiment.py, so that `python -m
grpojax.main` finds it in any install; this file keeps the
`--config experiments/arithmetic_tiny.py[:smoke]` spelling working.
"""

from grpojax.default_experiment import get_config  # noqa: F401
