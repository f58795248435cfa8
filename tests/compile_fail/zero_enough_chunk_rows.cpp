// A backend that declares enough_chunk_rows = 0 (a chunk never worth a row):
// a readable compile error where the operator plans its chunks, not chunks of
// one row at run time. The control variant declares 512, and compiles.
// expect: a backend's enough_chunk_rows must be at least one row
#include <lce/lce.hpp>

#include <cstdint>

#include "../support/device_shaped_backend.hpp"

struct declared_rows_backend : lce_test::device_shaped_backend<lce::host_memory> {
#ifdef LCE_COMPILE_FAIL_CONTROL
  static constexpr std::int64_t enough_chunk_rows = 512;
#else
  static constexpr std::int64_t enough_chunk_rows = 0;
#endif
};

using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::single, float, lce::budget_chunk, declared_rows_backend>;

std::int64_t rows(const op_t& op) { return op.chunk_tokens(1024, 64, 1000); }
