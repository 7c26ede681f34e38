"""Device mesh, shardings and multi-host initialisation."""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "mesh": ["batch_sharding", "global_batch", "initialize_distributed", "make_mesh", "resolve_shape"
],
})
