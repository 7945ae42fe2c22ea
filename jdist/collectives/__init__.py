"""The collective layer: the only part of jdist that knows about MPI.

Everything else asks it to reduce a pytree: inside a step with `psum`,
`pmean`, `all_gather`, `process_mean`, `reduce_payload` and `exchange` (`on_route(name)`: the same on
another route than the job's, for measurements). Host-side exchanges between
steps (`broadcast_params`, `host_allreduce`, `barrier`) are in
`jdist.runtime.host`.
"""

from jdist.collectives.context import mesh
from jdist.collectives.context import replica_index
from jdist.collectives.context import replica_key
from jdist.collectives.ops import all_gather
from jdist.collectives.ops import exchange
from jdist.collectives.ops import on_route
from jdist.collectives.ops import pmean
from jdist.collectives.ops import process_mean
from jdist.collectives.ops import psum
from jdist.collectives.ops import reduce_payload
from jdist.collectives.ops import require_data_parallel
from jdist.collectives.routes import route
from jdist.collectives.routes.base import DATA_AXIS
from jdist.collectives.routes.base import measure
