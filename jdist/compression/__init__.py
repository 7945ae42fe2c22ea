"""Gradient compression schemes, one module each (see `protocol`).

* `half`: `cast` (16-bit values on the wire) and `HalfPayload`.
* `sparse`: `topk`, `threshold` (selected entries, all-gathered) and
  `SparsePayload`.
* `powersgd`: `powersgd` (low-rank factors, summed), which replaces
  `jdist.allreduce` in the chain.
* `qsgd`: `qsgd` (8-bit levels + a float32 scale per bucket, all-gathered)
  and `QSGDPayload`, also `jdist.diloco`'s 8- and 4-bit payloads.
* `pack4`: 4-bit levels packed two per byte (`diloco(payload="int4")`),
  and narrower unsigned fields (2-bit codes, four per byte).
* `sparseloco`: SparseLoCo's payload, the top entries of each chunk in 2
  bits with uint16 offsets (`diloco(payload="sparse")`).

The public names are exported by `jdist` itself (`jdist.cast`,
`jdist.topk`, `jdist.powersgd`, ...); this package imports nothing, so
`jdist.compression.powersgd` stays the module.
"""
