// A user's tensor type without an lce::view_traits specialisation.
// expect: specialise lce::view_traits<YourType>
#include "common.hpp"

struct my_matrix {
  const float* p;
  long r, c;
  const float* data() const { return p; }
  long rows() const { return r; }
  long cols() const { return c; }
};

#ifdef LCE_COMPILE_FAIL_CONTROL
template <>
struct lce::view_traits<my_matrix> {
  using element_type = const float;
  static constexpr int rank = 2;
  static const float* data(const my_matrix& m) { return m.data(); }
  static long extent(const my_matrix& m, int i) { return i == 0 ? m.rows() : m.cols(); }
  static long stride(const my_matrix& m, int i) { return i == 0 ? m.cols() : 1; }
};
#endif

void call() { cf::op.forward(my_matrix{cf::x, 4, 4}, cf::W, cf::Y, cf::LP, cf::LSE); }
