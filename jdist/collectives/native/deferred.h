// Exchanges that outlive their step: the C interface of deferred.cc, whose
// XLA FFI handlers (CPU) split a native sum into a start and a finish.
//
//  * JdistDeferredStartCpu(device, x) -> token int32[3], attr `ordinal`:
//    copies x into memory of its own, posts it to the engine (engine.h) as
//    a sum under `ordinal` and returns at once. The token is
//    [ordinal, seq, session]: seq counts this device's starts of that
//    ordinal, session is `jdist_deferred_set_session`'s value.
//  * JdistDeferredFinishCpu(device, token) -> y (x's shape and dtype): an
//    XLA future completed with the sum once the engine has it. seq -1 takes
//    the oldest exchange of the ordinal not yet read. A token never started
//    in this process (or dropped by `jdist_deferred_drain`) is an error.
//  * JdistDeferredHeldCpu(device, token) -> int32: 1 where the token is this
//    session's and its exchange is still kept (a finish would read it).
//  * JdistDeferredSessionCpu() -> int32: the session, read at run time.
//
// The engine's deadline covers a started exchange as any other: one that
// another process never starts aborts the job.
#ifndef JDIST_COLLECTIVES_NATIVE_DEFERRED_H_
#define JDIST_COLLECTIVES_NATIVE_DEFERRED_H_

#include <cstdint>

extern "C" {

// Sets the session written into start tokens: one value per run of the job,
// the same on every process (a state restored from another run's checkpoint
// carries another session, so its exchanges are redone, not finished).
void jdist_deferred_set_session(int32_t value);

// Started exchanges (device parts) no finish has read yet.
int64_t jdist_deferred_outstanding(void);

// Waits until every started exchange completed (at most `timeout_s`), then
// forgets them all; returns how many no finish had read, or -1 on timeout.
int64_t jdist_deferred_drain(double timeout_s);

}  // extern "C"

#endif  // JDIST_COLLECTIVES_NATIVE_DEFERRED_H_
