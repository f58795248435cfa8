// lce's own bf16 x bf16 -> fp32 GEMM (lce/host/detail/own_bf16_gemm.hpp), on each unit
// (AMX tiles, AVX512-BF16 vectors) this CPU has, against a
// double-precision loop over the same bf16 values, at every transpose, ragged
// and whole 32 x 32 blocks, depths over one depth block (1,024) and alpha /
// beta as the provider contract has them. The bound is fp32 accumulation's:
// k u (|alpha| sum |a_i b_i| + |beta c|), u = 2^-24, which a wrong tile, pair
// order, packing or missing term exceeds by orders of magnitude. The split
// form (fp32 A as bf16 hi + lo) against the same loop over both parts, and the
// scratch each thread keeps against its stated bound. Each unit runs only on a
// CPU with it (the test says when it skips).
#include <lce/host/detail/own_bf16_gemm.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace {

using lce::bfloat16;
using lce::transpose;

using lce::detail::bf16_unit;

struct on_amx {
  static constexpr bf16_unit unit = bf16_unit::amx;
  static constexpr const char* missing = "this CPU (or OS) gives no AMX tiles";
};
struct on_avx512 {
  static constexpr bf16_unit unit = bf16_unit::avx512;
  static constexpr const char* missing = "this CPU (or OS) has no AVX512-BF16";
};

// Whether lce's kernel runs on this unit here; where it does not, the test says so.
template <class On>
bool runs_here() {
  if (lce::detail::own_bf16_gemm_available(On::unit)) return true;
  MESSAGE("skipped: " << On::missing << ", so lce's kernel does not run on it here");
  return false;
}

struct problem {
  std::int64_t m, n, k;
  transpose ta, tb;
  float alpha, beta;
  bool rows_of_512_bytes = false;  // A's rows 512 bytes apart or a multiple (packed, not read in place)
};

// The largest error / bound over C (every element, against a double sum of a(i, q) b(q, j)),
// and infinity if C's padding columns (j >= n) changed. The bound is fp32 accumulation's,
// (parts k + 2) u (|alpha| sum |a b| + |beta c|): `parts` products per k (two for a split A).
template <class AValue, class BValue>
double worst_error(const problem& p, AValue a, BValue b, const std::vector<float>& c, const std::vector<float>& before,
                   std::int64_t ldc, int parts) {
  double worst = 0.0;
  for (std::int64_t i = 0; i < p.m; ++i) {
    for (std::int64_t j = 0; j < ldc; ++j) {
      const float got = c[static_cast<std::size_t>(i * ldc + j)];
      const float old = before[static_cast<std::size_t>(i * ldc + j)];
      if (j >= p.n) {  // outside C: untouched, NaN or not
        if (!(got == old || (std::isnan(got) && std::isnan(old)))) return std::numeric_limits<double>::infinity();
        continue;
      }
      double sum = 0.0, magnitude = 0.0;
      for (std::int64_t q = 0; q < p.k; ++q) {
        const double x = a(i, q), y = b(q, j);
        sum += x * y;
        magnitude += std::fabs(x * y);
      }
      const double c_term = p.beta == 0.0f ? 0.0 : static_cast<double>(p.beta) * old;
      const double expected = p.alpha * sum + c_term;
      const double bound = static_cast<double>(parts * p.k + 2) * std::ldexp(1.0, -24) *
                               (std::fabs(p.alpha) * magnitude + std::fabs(c_term)) +
                           std::numeric_limits<float>::denorm_min();
      const double error = std::isfinite(got) ? std::fabs(got - expected) / bound : std::numeric_limits<double>::infinity();
      if (error > worst) worst = error;
    }
  }
  return worst;
}

// A and B of one problem with padded leading dimensions (A's rows 512 bytes apart or a
// multiple when asked), and C's: B holds bf16 values; A of floats holds values with more
// bits than bf16 holds, taken by the kernel as hi + lo. a(i, q) and b(q, j) are the values
// the kernel multiplies, in double: hi = bf16(a) plus lo = bf16(a - hi) (scalar
// lce::bfloat16 here; lo = 0 for a bf16 A); a kernel that dropped lo would be off by about
// 2^-9 |a b|.
template <class AElement, class BElement>
struct operands {
  bool at, bt;
  std::int64_t lda, ldb, ldc;
  std::vector<AElement> a_data;
  std::vector<BElement> b_data;

  operands(const problem& p, std::mt19937& rng) : at(p.ta == transpose::yes), bt(p.tb == transpose::yes) {
    const std::int64_t a_row = at ? p.m : p.k;
    lda = p.rows_of_512_bytes ? (a_row + 255) / 256 * 256 : a_row + 3;
    ldb = (bt ? p.k : p.n) + 5;
    ldc = p.n + 7;
    std::uniform_real_distribution<float> value(-2.0f, 2.0f);
    a_data.resize(static_cast<std::size_t>((at ? p.k : p.m) * lda));
    b_data.resize(static_cast<std::size_t>((bt ? p.n : p.k) * ldb));
    for (auto& x : a_data)
      x = static_cast<AElement>(std::same_as<AElement, float> ? value(rng) : static_cast<float>(bfloat16(value(rng))));
    for (auto& x : b_data) x = static_cast<BElement>(static_cast<float>(bfloat16(value(rng))));
  }

  double a(std::int64_t i, std::int64_t q) const {
    const float x = static_cast<float>(a_data[static_cast<std::size_t>(at ? q * lda + i : i * lda + q)]);
    const float hi = static_cast<float>(bfloat16(x));
    return static_cast<double>(hi) + static_cast<float>(bfloat16(x - hi));
  }
  double b(std::int64_t q, std::int64_t j) const {
    return static_cast<double>(static_cast<float>(b_data[static_cast<std::size_t>(bt ? j * ldb + q : q * ldb + j)]));
  }
};

// Runs one problem: own_bf16_gemm for a bf16 A, own_split_bf16_gemm for an fp32 A (B in bf16
// or as floats holding bf16 values); checks every element of C and that its padding columns
// keep their values.
template <class AElement = bfloat16, class BElement = bfloat16>
double run(bf16_unit unit, const problem& p, std::mt19937& rng) {
  const operands<AElement, BElement> in(p, rng);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<float> c(static_cast<std::size_t>(p.m * in.ldc));
  // beta = 0 must not read C: NaN there would otherwise show.
  for (auto& x : c) x = p.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN() : value(rng);
  const std::vector<float> before = c;
  constexpr bool split = std::same_as<AElement, float>;
  if constexpr (split)
    lce::detail::own_split_bf16_gemm(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, in.a_data.data(), in.lda,
                                     in.b_data.data(), in.ldb, p.beta, c.data(), in.ldc);
  else
    lce::detail::own_bf16_gemm(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, in.a_data.data(), in.lda, in.b_data.data(),
                               in.ldb, p.beta, c.data(), in.ldc);
  return worst_error(
      p, [&](std::int64_t i, std::int64_t q) { return in.a(i, q); },
      [&](std::int64_t q, std::int64_t j) { return in.b(q, j); }, c, before, in.ldc, split ? 2 : 1);
}

template <class BElement>
double run_split(bf16_unit unit, const problem& p, std::mt19937& rng) {
  return run<float, BElement>(unit, p, rng);
}

// check(p) for every shape, both transposes of A and of B, and the alpha / beta pairs the
// provider contract has (alpha != 1 and beta = -1.5 included).
template <std::size_t Shapes, class Check>
void for_each_problem(const std::int64_t (&shapes)[Shapes][3], Check&& check) {
  const transpose both[] = {transpose::no, transpose::yes};
  const std::pair<float, float> scales[] = {{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, 0.0f}, {-0.25f, 1.0f}, {1.0f, -1.5f}};
  for (const auto& shape : shapes)
    for (const transpose ta : both)
      for (const transpose tb : both)
        for (const auto& scale : scales) {
          const problem p{shape[0], shape[1], shape[2], ta, tb, scale.first, scale.second};
          CAPTURE(p.m);
          CAPTURE(p.n);
          CAPTURE(p.k);
          CAPTURE(ta == transpose::yes);
          CAPTURE(tb == transpose::yes);
          CAPTURE(p.alpha);
          CAPTURE(p.beta);
          check(p);
        }
}

}  // namespace

TEST_CASE_TEMPLATE("Own split bf16 GEMM: A in fp32 as hi + lo, B in bf16 or fp32, every transpose, alpha and beta",
                   On, on_amx, on_avx512) {
  if (!runs_here<On>()) return;
  constexpr bf16_unit unit = On::unit;
  std::mt19937 rng(2027);
  const std::int64_t shapes[][3] = {{32, 32, 32}, {1, 1, 1}, {17, 45, 3}, {33, 31, 100}, {64, 64, 1024},
                                    {40, 70, 1100}, {96, 33, 2100}};
  for_each_problem(shapes, [&](const problem& p) {
    CHECK(run_split<bfloat16>(unit, p, rng) <= 1.0);
    CHECK(run_split<float>(unit, p, rng) <= 1.0);
  });
  // lce::host's shapes: dX (dz W over a vocabulary) and dW (dz^T X, X's rows as floats).
  CHECK(run_split<bfloat16>(unit, {64, 96, 3000, transpose::no, transpose::no, 1.0f, 0.0f}, rng) <= 1.0);
  CHECK(run_split<float>(unit, {200, 96, 70, transpose::yes, transpose::no, 1.0f, 1.0f}, rng) <= 1.0);
}

TEST_CASE_TEMPLATE("Own bf16 GEMM: every transpose, ragged and whole blocks, deep sums, alpha and beta", On, on_amx,
                   on_avx512) {
  if (!runs_here<On>()) return;
  std::mt19937 rng(2026);
  // Whole blocks (in-place C), ragged edges, one depth step, depths past one and two depth
  // blocks (1,024) with a ragged last step; m over 32 with A packed (transposed).
  const std::int64_t shapes[][3] = {{32, 32, 32},  {64, 96, 64},  {1, 1, 1},     {17, 45, 3},   {33, 31, 100},
                                    {64, 64, 1024}, {40, 70, 1100}, {64, 96, 2080}, {96, 33, 2100}, {5, 530, 1500}};
  for_each_problem(shapes, [&](const problem& p) { CHECK(run(On::unit, p, rng) <= 1.0); });
}

TEST_CASE_TEMPLATE("Own bf16 GEMM: lce_torch's shapes (logits into a wide C, dX over the vocabulary, dW)", On, on_amx,
                   on_avx512) {
  if (!runs_here<On>()) return;
  const auto run = [](const problem& p, std::mt19937& rng) { return ::run(On::unit, p, rng); };
  std::mt19937 rng(7);
  CHECK(run({64, 200, 256, transpose::no, transpose::yes, 1.0f, 0.0f}, rng) <= 1.0);  // logits
  CHECK(run({64, 96, 3000, transpose::no, transpose::no, 1.0f, 0.0f}, rng) <= 1.0);   // dX
  CHECK(run({130, 96, 70, transpose::yes, transpose::no, 1.0f, 1.0f}, rng) <= 1.0);   // dW
  // A's rows at a multiple of 512 bytes (H = 1,024 in bf16): packed rather than read in place.
  CHECK(run({64, 200, 256, transpose::no, transpose::yes, 1.0f, 0.0f, true}, rng) <= 1.0);
  CHECK(run({40, 96, 3000, transpose::no, transpose::no, 1.0f, 1.0f, true}, rng) <= 1.0);
  CHECK(run({64, 70, 1024, transpose::no, transpose::yes, 0.5f, 0.0f, true}, rng) <= 1.0);
  // Packed A in slices held in L1 (own_kernel::l1_slice_steps), C's whole blocks summed in
  // place slice by slice: from zero and onto C (beta 1), over one and two depth blocks.
  CHECK(run({64, 96, 1024, transpose::no, transpose::yes, 1.0f, 0.0f, true}, rng) <= 1.0);
  CHECK(run({64, 96, 1024, transpose::no, transpose::yes, 1.0f, 1.0f, true}, rng) <= 1.0);
  CHECK(run({32, 64, 2300, transpose::yes, transpose::no, 1.0f, 1.0f}, rng) <= 1.0);
  // dW of the vocabulary order's tile (dz^T packed, over more columns than one 1,024-deep
  // block holds): two 512-deep blocks, the second added through C, beta 0 and 1.
  CHECK(run({96, 1024, 1000, transpose::yes, transpose::no, 0.25f, 0.0f}, rng) <= 1.0);
  CHECK(run({96, 1000, 1024, transpose::yes, transpose::no, 1.0f, 1.0f}, rng) <= 1.0);
}

// own_bf16_gemm_into_bf16: C in bf16 gets bf16(alpha A B + beta C), beta 1 or 0 (C then
// NaN: not read). Against two references: bit for bit, the kernel's own fp32 GEMM (beta 0)
// followed by a scalar rounded add or copy (the host's scratch path), where that GEMM sums
// k in one depth block too; and, at any depth, a double sum: the result within fp32
// accumulation's bound plus half an ulp of bf16 of alpha A B + beta C. C's padding columns
// stay as they were.
template <class AElement, class BElement>
void check_into_bf16(bf16_unit unit, const problem& p, std::mt19937& rng) {
  const operands<AElement, BElement> in(p, rng);
  const std::int64_t lda = in.lda, ldb = in.ldb, ldc = in.ldc;
  const auto& a = in.a_data;
  const auto& b = in.b_data;
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<bfloat16> c(static_cast<std::size_t>(p.m * ldc));
  for (std::int64_t i = 0; i < p.m; ++i)
    for (std::int64_t j = 0; j < ldc; ++j)
      c[static_cast<std::size_t>(i * ldc + j)] =
          bfloat16(p.beta == 0.0f && j < p.n ? std::numeric_limits<float>::quiet_NaN() : value(rng) * 8.0f);
  const std::vector<bfloat16> before = c;
  lce::detail::own_bf16_gemm_into_bf16(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, a.data(), lda, b.data(), ldb,
                                       p.beta, c.data(), ldc);

  // The fp32 GEMM's one depth block: k <= 512, or one column block of packed B (see blocking::choose).
  if (p.k <= 512 || p.n <= 512) {
    std::vector<float> sum(static_cast<std::size_t>(p.m * p.n));
    if constexpr (std::same_as<AElement, float>)
      lce::detail::own_split_bf16_gemm(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, a.data(), lda, b.data(), ldb, 0.0f,
                                       sum.data(), p.n);
    else
      lce::detail::own_bf16_gemm(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, a.data(), lda, b.data(), ldb, 0.0f,
                                 sum.data(), p.n);
    std::int64_t differing = 0;
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        const float s = sum[static_cast<std::size_t>(i * p.n + j)];
        const bfloat16 expected(p.beta == 0.0f ? s : static_cast<float>(before[static_cast<std::size_t>(i * ldc + j)]) + s);
        differing += expected.bits != c[static_cast<std::size_t>(i * ldc + j)].bits;
      }
    CHECK(differing == 0);
  }

  const auto a_at = [&](std::int64_t i, std::int64_t q) { return in.a(i, q); };
  const auto b_at = [&](std::int64_t q, std::int64_t j) { return in.b(q, j); };
  const int parts = std::same_as<AElement, float> ? 2 : 1;
  double worst = 0.0;
  for (std::int64_t i = 0; i < p.m; ++i)
    for (std::int64_t j = 0; j < ldc; ++j) {
      const bfloat16 got = c[static_cast<std::size_t>(i * ldc + j)], old = before[static_cast<std::size_t>(i * ldc + j)];
      if (j >= p.n) {
        CHECK(got.bits == old.bits);
        continue;
      }
      double sum = 0.0, magnitude = 0.0;
      for (std::int64_t q = 0; q < p.k; ++q) {
        sum += a_at(i, q) * b_at(q, j);
        magnitude += std::fabs(a_at(i, q) * b_at(q, j));
      }
      const double c_term = p.beta == 0.0f ? 0.0 : static_cast<double>(static_cast<float>(old));
      const double expected = c_term + p.alpha * sum;
      const double bound = static_cast<double>(parts * p.k + 3) * std::ldexp(1.0, -24) *
                               (std::fabs(p.alpha) * magnitude + std::fabs(c_term)) +
                           std::ldexp(std::fabs(expected), -8) + std::numeric_limits<float>::denorm_min();
      worst = std::max(worst, std::fabs(static_cast<float>(got) - expected) / bound);
    }
  CHECK(worst <= 1.0);
}

TEST_CASE_TEMPLATE("Own GEMM into a bf16 C: bf16(alpha A B + beta C), the bits of the fp32 GEMM and a rounded add",
                   On, on_amx, on_avx512) {
  if (!runs_here<On>()) return;
  constexpr bf16_unit unit = On::unit;
  std::mt19937 rng(2028);
  // Ragged and whole blocks, one step, a whole 1,024-deep block over more columns than packed B
  // holds at that depth, and past it (the fp32 sum in a buffer of its own).
  const std::int64_t shapes[][3] = {{32, 32, 32}, {1, 1, 1},       {17, 45, 3},    {33, 31, 100},
                                    {64, 96, 512}, {40, 700, 1000}, {96, 33, 1024}, {20, 50, 1500}};
  const transpose both[] = {transpose::no, transpose::yes};
  for (const auto& shape : shapes)
    for (const transpose ta : both)
      for (const transpose tb : both)
        for (const auto& [alpha, beta] : {std::pair{1.0f, 1.0f}, std::pair{-0.375f, 1.0f}, std::pair{1.0f, 0.0f},
                                          std::pair{0.5f, 0.0f}}) {
          const problem p{shape[0], shape[1], shape[2], ta, tb, alpha, beta};
          CAPTURE(p.m);
          CAPTURE(p.n);
          CAPTURE(p.k);
          CAPTURE(ta == transpose::yes);
          CAPTURE(tb == transpose::yes);
          CAPTURE(alpha);
          CAPTURE(beta);
          check_into_bf16<bfloat16, bfloat16>(unit, p, rng);
          check_into_bf16<float, float>(unit, p, rng);
        }
  // dW tiles as lce::host takes them: dz^T (transposed) against the hidden rows, 512 x 1,024 at N = 256 / 1,024.
  check_into_bf16<bfloat16, bfloat16>(unit, {512, 1024, 256, transpose::yes, transpose::no, 1.0f, 1.0f}, rng);
  check_into_bf16<float, float>(unit, {128, 1024, 512, transpose::yes, transpose::no, 1.0f, 0.0f}, rng);
}

TEST_CASE_TEMPLATE("Own GEMM into a bf16 C: sums below fp32's normal range keep lce::bfloat16's bits", On, on_amx,
                   on_avx512) {
  if (!runs_here<On>()) return;
  constexpr bf16_unit unit = On::unit;
  std::mt19937 rng(2029);
  // alpha = 2^-133 takes most of alpha A B below 2^-126: subnormal floats, which the CPU's
  // own bf16 conversion (VCVTNE2PS2BF16) would flush to zero, and lce::bfloat16 rounds to
  // subnormal bf16. Whole 32-column blocks and ragged ones, beta 0 and 1.
  for (const auto& [n, beta] : {std::pair{std::int64_t{64}, 0.0f}, std::pair{std::int64_t{64}, 1.0f},
                                std::pair{std::int64_t{45}, 0.0f}}) {
    const problem p{64, n, 64, transpose::no, transpose::no, 0x1p-133f, beta};
    CAPTURE(n);
    CAPTURE(beta);
    const operands<bfloat16, bfloat16> in(p, rng);
    std::vector<bfloat16> c(static_cast<std::size_t>(p.m * in.ldc));
    for (std::size_t i = 0; i < c.size(); ++i)  // subnormal bf16 too, where C is added to
      c[i] = bfloat16(static_cast<float>(i % 5) * 0x1p-131f);
    const std::vector<bfloat16> before = c;
    lce::detail::own_bf16_gemm_into_bf16(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, in.a_data.data(), in.lda,
                                         in.b_data.data(), in.ldb, p.beta, c.data(), in.ldc);
    std::vector<float> sum(static_cast<std::size_t>(p.m * p.n));
    lce::detail::own_bf16_gemm(unit, p.ta, p.tb, p.m, p.n, p.k, p.alpha, in.a_data.data(), in.lda,
                               in.b_data.data(), in.ldb, 0.0f, sum.data(), p.n);
    std::int64_t differing = 0, subnormal = 0;
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        const std::size_t at = static_cast<std::size_t>(i * in.ldc + j);
        const float s = sum[static_cast<std::size_t>(i * p.n + j)];
        const bfloat16 expected(p.beta == 0.0f ? s : static_cast<float>(before[at]) + s);
        differing += expected.bits != c[at].bits;
        subnormal += (expected.bits & 0x7f80u) == 0 && (expected.bits & 0x7fu) != 0;
      }
    CHECK(differing == 0);
    CHECK(subnormal > p.m * p.n / 4);  // the case this test is for
  }
}

TEST_CASE_TEMPLATE("Own bf16 GEMM: an empty C or depth", On, on_amx, on_avx512) {
  if (!runs_here<On>()) return;
  constexpr bf16_unit unit = On::unit;
  std::vector<float> c = {1.0f, 2.0f, 3.0f, 4.0f};
  const bfloat16 none{};
  lce::detail::own_bf16_gemm(unit, transpose::no, transpose::no, 2, 2, 0, 1.0f, &none, 1, &none, 2, 0.5f, c.data(), 2);
  CHECK(c == std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f});
  lce::detail::own_bf16_gemm(unit, transpose::no, transpose::no, 2, 2, 0, 1.0f, &none, 1, &none, 2, 0.0f, c.data(), 2);
  CHECK(c == std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f});
  lce::detail::own_bf16_gemm(unit, transpose::no, transpose::no, 0, 2, 5, 1.0f, &none, 1, &none, 2, 0.0f, c.data(), 2);
  CHECK(c == std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f});
}

TEST_CASE_TEMPLATE("Own bf16 GEMM: its scratch per thread stays within own_bf16_gemm_scratch_bytes", On, on_amx,
                   on_avx512) {
  if (!runs_here<On>()) return;
  constexpr bf16_unit unit = On::unit;
  // A fresh thread, so that its scratch starts empty. Shallow and wide (each 16-column stream
  // padded to 4 KiB), deep with ragged blocks and alpha != 1 (the sum between depth blocks
  // goes through C, not scratch), tall (C's rows never in scratch), and A packed at depth
  // 1,024 over 512 columns, which takes the whole bound.
  const problem problems[] = {
      {32, 20000, 32, transpose::no, transpose::yes, 1.0f, 0.0f},
      {16, 9000, 100, transpose::yes, transpose::no, 0.5f, 1.0f},
      {70, 600, 5000, transpose::no, transpose::no, -0.5f, 1.0f},
      {2100, 40, 3000, transpose::no, transpose::no, 2.0f, 0.0f},
      {64, 700, 1024, transpose::no, transpose::yes, 1.0f, 0.0f, true},
      {384, 700, 1024, transpose::no, transpose::yes, 1.0f, 0.0f, true},
  };
  // A packed over 700 columns is cut 512 deep where C fits in L2 (64 rows); 384 rows keep the
  // 1,024-deep block. ... And a split A at depth 1,024 (both parts packed; 448 rows, so
  // not cut), which takes the whole bound.
  const problem split{448, 600, 1024, transpose::no, transpose::no, 1.0f, 0.0f};
  std::size_t largest = 0;
  bool within = true, correct = true;
  std::thread([&] {
    std::mt19937 rng(11);
    for (const problem& p : problems) {
      correct = correct && run(unit, p, rng) <= 1.0;
      const std::size_t held = lce::detail::own_bf16_gemm_thread_scratch_bytes();
      within = within && held <= lce::detail::own_bf16_gemm_scratch_bytes;
      largest = std::max(largest, held);
    }
    correct = correct && run_split<bfloat16>(unit, split, rng) <= 1.0;
    const std::size_t held = lce::detail::own_bf16_gemm_thread_scratch_bytes();
    within = within && held <= lce::detail::own_bf16_gemm_scratch_bytes;
    largest = std::max(largest, held);
  }).join();
  CHECK(correct);
  CHECK(within);
  CHECK(largest == lce::detail::own_bf16_gemm_scratch_bytes);  // the bound is reached, not loose
  CHECK(lce::detail::own_bf16_gemm_scratch_bytes == 1224 * 1024);
}
