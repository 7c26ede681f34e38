"""How a run is put together from its config. `fit`: the memory fitting of the "auto"
sizes, which the trainer and the planner (grpojax.plan) share.

The names below load on first use."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {})
