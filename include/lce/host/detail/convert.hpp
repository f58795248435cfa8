#pragma once
// Element conversions between storage and compute types, row by row.
// Branch-free conversions (core/dtypes.hpp) let these loops vectorise.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>

#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

template <class From, class To>
void convert_span(const From* LCE_RESTRICT source, To* LCE_RESTRICT target, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) target[j] = convert<To>(source[j]);
}

// target += source, summed in the wider of the two types and rounded once.
template <class From, class To>
void add_span(const From* LCE_RESTRICT source, To* LCE_RESTRICT target, std::int64_t n) {
  using Sum = std::conditional_t<std::same_as<From, double> || std::same_as<To, double>, double, float>;
  for (std::int64_t j = 0; j < n; ++j) target[j] = convert<To>(convert<Sum>(target[j]) + convert<Sum>(source[j]));
}

}  // namespace detail
LCE_END_NAMESPACE
