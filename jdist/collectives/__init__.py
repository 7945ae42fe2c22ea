"""The collective layer: the only part of jdist that knows about MPI.

Everything else asks it to reduce a pytree: inside a step with `psum`,
`pmean`, `all_gather` and `reduce_payload`; on the host with
`broadcast_params`, `host_allreduce` and `barrier`.
"""

from jdist.collectives.context import mesh
from jdist.collectives.context import replica_index
from jdist.collectives.context import replica_key
from jdist.collectives.host import allgather_object
from jdist.collectives.host import barrier
from jdist.collectives.host import broadcast_params
from jdist.collectives.host import host_allreduce
from jdist.collectives.ops import all_gather
from jdist.collectives.ops import check_structure
from jdist.collectives.ops import pmean
from jdist.collectives.ops import psum
from jdist.collectives.ops import reduce_payload
from jdist.collectives.ops import require_data_parallel
from jdist.collectives.transport import DATA_AXIS
from jdist.collectives.transport import measure
from jdist.collectives.transport import route
