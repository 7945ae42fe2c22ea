"""`jdist.timeline`: each rank's steps and exchanges as one Chrome / Perfetto trace.

  * `recorder`: what each rank records while a timeline is on, and the gather
    to rank 0 at the end (`jdist.timeline`, `Timeline`);
  * `chrome_trace`: the records as Chrome trace events, and their summary;
  * `counters`: the compression ratio and residual norm a loop may add.
"""
