// A view_traits specialisation that forgets stride().
// expect: lce::view_traits<YourType> is incomplete
#include "common.hpp"

struct my_matrix {
  const float* p;
  long r, c;
};

template <>
struct lce::view_traits<my_matrix> {
  using element_type = const float;
  static constexpr int rank = 2;
  static const float* data(const my_matrix& m) { return m.p; }
  static long extent(const my_matrix& m, int i) { return i == 0 ? m.r : m.c; }
#ifdef LCE_COMPILE_FAIL_CONTROL
  static long stride(const my_matrix& m, int i) { return i == 0 ? m.c : 1; }
#endif
};

void call() { cf::op.forward(my_matrix{cf::x, 4, 4}, cf::W, cf::Y, cf::LP, cf::LSE); }
