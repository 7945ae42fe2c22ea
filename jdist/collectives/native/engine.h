// jdist's native cross-process exchange engine: the C interface shared by the
// CPU library (engine.cc, which holds the engine, and ffi_cpu.cc, the CPU FFI
// handler) and the CUDA library (exchange_cuda.cc, which stages device
// buffers through pinned host memory and posts them here).
//
// An exchange is identified by its `ordinal` (unique within one compiled
// step, fixed at trace time, identical on every process) and by how many
// times each local device has posted that ordinal before. Every local
// device posts its part; once all have, the engine reduces them locally and
// runs the cross-process part with non-blocking point-to-point MPI on a
// communicator of its own, tagged by ordinal (and segment: a large sum
// crosses in pieces, each sent as soon as it is reduced locally). Nothing
// waits for another exchange, so exchanges may run in any order on any
// device.
#ifndef JDIST_COLLECTIVES_NATIVE_ENGINE_H_
#define JDIST_COLLECTIVES_NATIVE_ENGINE_H_

#include <cstdint>

extern "C" {

// What an exchange computes.
enum JdistKind {
  JDIST_SUM = 0,     // elementwise sum over every replica, in the input dtype
  JDIST_SUM16 = 1,   // float16/bfloat16 sum: 16 bits on the wire, float32 adds
  JDIST_GATHER = 2,  // every replica's buffer, in replica order (bytes)
  // A flag or'ed into a sum's kind: a background sum (deferred.h's starts),
  // which yields to the others, paced in small segments (pacing.h).
  JDIST_BACKGROUND = 16,
};

// Element types the engine knows.
enum JdistElem {
  JDIST_F32 = 0,
  JDIST_F64 = 1,
  JDIST_I32 = 2,
  JDIST_I64 = 3,
  JDIST_U32 = 4,
  JDIST_F16 = 5,
  JDIST_BF16 = 6,
  JDIST_U8 = 7,
};

// Called once per posted part when its output is written; `error` is null on
// success. Runs on one of the engine's completion threads, which may block.
typedef void (*JdistDone)(void* arg, const char* error);

// Starts the engine on a communicator given by its Fortran handle (mpi4py's
// `comm.py2f()`); `local_devices` parts make one exchange; an exchange that
// waits longer than `timeout_s` aborts the job. `nodes`, each rank's node
// index (as many as the communicator's ranks, the same on every rank, every
// node with as many ranks), makes sums node-aware (hierarchy.h); null keeps
// them flat. Returns 0, or -1 with a message in `jdist_last_error()`.
// Idempotent.
int jdist_start(int comm_f, int local_devices, double timeout_s, const int* nodes);

// 1 when the running engine's sums are node-aware, else 0.
int jdist_hierarchical(void);

// Makes the next sums node-aware (1) or flat (0); every process must set the
// same, between steps. Returns the previous setting, or -1 (nothing changed)
// where the engine started without a node map.
int jdist_set_hierarchical(int on);

// Stops the engine thread (before MPI_Finalize). Idempotent.
void jdist_stop(void);

// 1 while the engine runs.
int jdist_running(void);

// The last start error, or "".
const char* jdist_last_error(void);

// Exchanges completed since start (for tests and benchmarks).
int64_t jdist_completed(void);

// Segments (exchange.h) that crossed processes since start.
int64_t jdist_segments_completed(void);

// Segments whose messages were handed to MPI since start (the difference
// with jdist_segments_completed is what is on the wire).
int64_t jdist_segments_posted(void);

// With JDIST_NATIVE_TRACE set, moves up to `max_rows` rows of the exchange
// timeline (trace.h's columns, 8 int64 each) into `rows`; returns how many.
int64_t jdist_trace_take(int64_t* rows, int64_t max_rows);

// Turns the exchange timeline on (1) or off (0) at run time; returns whether
// it was on. JDIST_NATIVE_TRACE turns it on at start.
int jdist_trace_enable(int on);

// Copies the flight recorder's newest rows (flight.h's columns, 9 int64 each,
// oldest first, at most 256) into `rows`; returns how many. Always recorded.
int64_t jdist_flight_snapshot(int64_t* rows, int64_t max_rows);

// Sets how many wire bytes of a sum cross processes as one segment (a
// reduce-scatter and all-gather of their own, pipelined with the local
// reduction of the next); <= 0 sends each sum whole. Every process must use
// the same value for an exchange (set it between steps). Starts from
// $JDIST_NATIVE_SEGMENT_BYTES, else 4 MiB. Returns the previous value.
int64_t jdist_set_segment_bytes(int64_t bytes);

// Sets how many wire bytes of a background sum cross as one segment, one
// at a time per ordinal (pacing.h); <= 0 sends background sums as any other.
// Every process must use the same value (set it between steps). Starts from
// $JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES, else 64 KiB. Returns the previous.
int64_t jdist_set_background_segment_bytes(int64_t bytes);

// Posts local device `device`'s part of an exchange: `count` elements of
// `elem` at `in`; the result goes to `out` (count elements for sums,
// replicas * count for gathers). `done(arg, error)` is called once.
void jdist_post(int device, int64_t ordinal, int kind, int elem, int64_t count,
                const void* in, void* out, JdistDone done, void* arg);

}  // extern "C"

#endif  // JDIST_COLLECTIVES_NATIVE_ENGINE_H_
