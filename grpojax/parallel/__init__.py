"""Device mesh, shardings and multi-host initialisation."""

from grpojax.parallel.mesh import (batch_sharding, global_batch, initialize_distributed,
                                   make_mesh, resolve_shape)
