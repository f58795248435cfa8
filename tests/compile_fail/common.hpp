// Shared by the compile-fail snippets: an operator and well-formed arguments
// for every parameter but the one a snippet gets wrong.
#pragma once
#include <lce/lce.hpp>

#include <cstdint>

namespace cf {
inline float x[64] = {};
inline std::int64_t y[4] = {};
inline float lp[4] = {}, lse[4] = {};
inline lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};
inline const lce::matrix_view<const float> W{x, 8, 4};
inline const lce::vector_view<const std::int64_t> Y{y, 4};
inline const lce::vector_view<float> LP{lp, 4}, LSE{lse, 4};
}  // namespace cf
