"""How a run is put together from its config, one way for the trainer and the planner
(grpojax.plan). `assemble`: from a config to the run's parts, real or abstract. `fit`:
the memory fitting of the "auto" sizes.

The names below load on first use."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {})
