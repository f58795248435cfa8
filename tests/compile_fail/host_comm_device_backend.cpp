// A communicator over host memory (lce::comm::threads) with a backend whose
// buffers live on a device (as lce::cuda_backend's do): a readable compile
// error, not a crash at the first collective. The control variant gives the
// same backend host memory, and compiles.
// expect: the communicator's collectives must work on the backend's memory
#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <cstddef>

#include "../support/device_shaped_backend.hpp"

#ifdef LCE_COMPILE_FAIL_CONTROL
using device_like_backend = lce_test::device_shaped_backend<lce::host_memory>;
#else
using device_like_backend = lce_test::device_shaped_backend<lce::device_memory>;
#endif
static_assert(lce::backend<device_like_backend>, "the fake backend must satisfy the concept: the failure is the memory");

using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::threads, lce::bfloat16, lce::budget_chunk, device_like_backend>;

std::size_t size() { return sizeof(op_t); }
