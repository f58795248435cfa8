// A backend whose min_efficient_chunk_rows exceed its enough_chunk_rows (a
// call's share could then ask for more rows than a chunk is ever worth): a
// readable compile error where the operator plans its chunks. The control
// variant declares 192 under 512, and compiles.
// expect: a backend's min_efficient_chunk_rows must be at least one row and at most its enough_chunk_rows
#include <lce/lce.hpp>

#include <cstdint>

#include "../support/device_shaped_backend.hpp"

struct declared_rows_backend : lce_test::device_shaped_backend<lce::host_memory> {
  static constexpr std::int64_t enough_chunk_rows = 512;
#ifdef LCE_COMPILE_FAIL_CONTROL
  static constexpr std::int64_t min_efficient_chunk_rows = 192;
#else
  static constexpr std::int64_t min_efficient_chunk_rows = 1024;
#endif
};

using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::single, float, lce::budget_chunk, declared_rows_backend>;

std::int64_t rows(const op_t& op) { return op.chunk_tokens(1024, 64, 1000); }
