#pragma once
// lce's own bf16 x bf16 -> fp32 GEMM, single-threaded, for the host backend's
// GEMM tiles: lce calls one per tile from each of its threads
// (gemm_provider.hpp). It runs on one of two units (bf16_unit), the same
// packing, blocking and edges around either:
//
//   amx     Intel's AMX tiles (Sapphire Rapids and later Xeons)
//   avx512  AVX512-BF16's VDPBF16PS in zmm registers (AMD Zen 4 and later,
//           Intel Cooper Lake; AMX Xeons have it too)
//
// Why lce has its own: lce needs an fp32 output (its logits, row sums and dX
// summed over vocabulary tiles), and the bf16 GEMMs with one that a library
// user can link do not reach what the CPU allows at lce's shapes. On a 2-core
// AMX Xeon, at the three GEMMs of a chunk of 512 tokens (H 1,024, V 32,000),
// MKL's cblas_gemm_bf16bf16f32 ran 103 ms and the oneDNN 3.2 wheel 107 ms on
// two threads; this kernel on the tiles runs them in 66-71 ms
// (bench/bf16_gemm.cpp's `lce amx` rows). On another such Xeon, model 167: 84
// ms before packed A went through L1 in slices (l1_slice_steps), 75-80 ms
// since, where Debian's oneDNN 2.6 ran 109-111 ms and MKL 90 ms. PyTorch's
// own bf16 matmuls (the oneDNN inside libtorch_cpu, bf16 output only, not
// callable with an fp32 one) ran 64 ms on the first Xeon and, in PyTorch 2.13
// (oneDNN 3.12), 52 ms on the second. On lce_torch's own calls (tiles of 1,024
// vocabulary rows, two halves of 512: bf16_gemm.cpp's `lce amx calls`), since
// the sums between slices wait in scratch and a step's lines are staged before
// packing, this kernel ran them in 118-129 ms on one core of the second Xeon
// and 62-68 ms on two, where torch.mm ran the whole GEMMs in 107-130 ms and
// 55-63 ms, and the same calls in 111-140 ms on one core (three runs, one
// session). On a 2-core AMD EPYC (Zen 5), MKL's runs 205-228 GFLOP/s on two
// threads (it does not use AVX512-BF16 there), PyTorch's own 784-893, Debian's
// oneDNN 2.6 832 / 717 / 694 (logits / dX / dW at 512 tokens), and this kernel
// on AVX512-BF16 886 / 844 / 701 (bench/bf16_gemm.cpp's `lce avx512` rows). The host
// backend's default provider (cblas_gemm, through bf16_gemm_choice.hpp) and
// lce_torch run their bf16 GEMMs on it wherever the CPU has either unit. Its
// split form (own_split_bf16_gemm) takes an fp32 A, dz, to 16 bits as two
// bf16 parts while packing it, so that lce::host's dX and dW keep that
// precision without a pass of their own over dz.
//
// Memory: packed B and packed A live in scratch of the calling thread's, kept
// for reuse like a BLAS's own buffers, at most own_bf16_gemm_scratch_bytes
// (1,224 KiB) whatever the shapes; C is never copied, so the scratch does not
// grow with the rows of a call.
//
// The kernel sums a 32 x 32 block of C over a depth block (up to 1,024),
// then writes it to C: whole blocks with alpha = 1 and beta 0 or 1 as they
// are (the next depth block reloads them), other blocks as alpha times the
// depth block's sum added into C (beta C at the first, masks for ragged
// edges). On AMX the block is four 16 x 16 fp32 tiles, each TDPBF16PS
// multiplying a 16 x 32 bf16 tile of A by a 32 x 16 tile of B; on AVX-512
// it is summed 8 rows at a time in 16 zmm registers, each VDPBF16PS adding
// a broadcast pair (k, k + 1) of one row of A times 16 columns of B. Either
// way products of bf16 values are exact in fp32 and every sum is an fp32
// sum, as the provider contract asks; the order of the sums depends on the
// shapes and the unit only.
//
// Operand layouts. A tile row must hold 32 consecutive k of one row of A:
// an A whose k runs along memory (transpose::no) is read in place unless
// its rows alias in L1 (see gemm); otherwise A is packed, 32 rows at a
// time. B must be in the "VNNI" form, pairs (k, k + 1) side by side for
// each column: a B whose columns run along memory (transpose::no, the
// weight in dX) has two rows interleaved per pair, a transposed B (the
// weight in the logits, W[v, h] read as B[h, v]) is a 16 x 16 transpose of
// 32-bit pairs. B is packed 32 or more columns at a time into this thread's
// scratch, each pair row 64 bytes, so every tile load (or the two vector
// loads of a pair row) reads whole cache lines.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/detail/widening_bf16_gemm.hpp>
#include <lce/host/gemm_provider.hpp>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define LCE_HAS_OWN_BF16_KERNEL 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LCE_HAS_OWN_BF16_KERNEL 0
#endif

#include <algorithm>
#include <array>
#include <cstring>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <new>
#include <optional>

LCE_BEGIN_NAMESPACE
namespace detail {

// The unit lce's own bf16 GEMM runs on: Intel's AMX tiles, or AVX-512's bf16 dot products.
enum class bf16_unit { amx, avx512 };

#if LCE_HAS_OWN_BF16_KERNEL

// What cpuid and XCR0 say of the x86 features the two units need (zero where the OS does not
// use XSAVE).
struct x86_bf16_features {
  unsigned leaf7_ebx = 0, leaf7_edx = 0, leaf7_1_eax = 0;
  std::uint64_t xcr0 = 0;

  static x86_bf16_features read() {
    x86_bf16_features f;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return f;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
    f.leaf7_ebx = b, f.leaf7_edx = d;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.leaf7_1_eax = a;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    f.xcr0 = (std::uint64_t{hi} << 32) | lo;
    return f;
  }
  // AVX-512 F, DQ, BW and VL, and the OS saves the zmm state.
  bool avx512() const {
    constexpr unsigned f_dq_bw_vl = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    constexpr std::uint64_t zmm_state = 0xe6;
    return (leaf7_ebx & f_dq_bw_vl) == f_dq_bw_vl && (xcr0 & zmm_state) == zmm_state;
  }
  bool avx512_bf16() const { return avx512() && (leaf7_1_eax & (1u << 5)); }
  // AMX-BF16 and AMX-TILE, and the OS saves the tile state.
  bool amx_bf16() const {
    constexpr unsigned bf16_tile = (1u << 22) | (1u << 24);
    constexpr std::uint64_t tile_state = std::uint64_t{3} << 17;
    return avx512() && (leaf7_edx & bf16_tile) == bf16_tile && (xcr0 & tile_state) == tile_state;
  }
};

// Whether this CPU has AMX-BF16 and AVX-512, the OS saves their state, and Linux granted
// this process the tile data (ARCH_REQ_XCOMP_PERM, asked once: the grant holds for every
// thread of the process).
inline bool amx_bf16_gemm_available() {
  static const bool available = [] {
    if (!x86_bf16_features::read().amx_bf16()) return false;
    constexpr long request_permission = 0x1023, tile_data = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, request_permission, tile_data) == 0;
  }();
  return available;
}

// Whether this CPU has AVX512-BF16 (VDPBF16PS) with AVX-512 and the OS saves its state (AMD
// Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later).
inline bool avx512_bf16_gemm_available() {
  static const bool available = x86_bf16_features::read().avx512_bf16();
  return available;
}

// Every function of the kernel may run on either unit: no AMX instruction runs unless the
// AMX unit was chosen (AMX CPUs have AVX512-BF16 too).
#define LCE_BF16_KERNEL_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), a self-initialised
// variable that -Wuninitialized reports once they are inlined into a function with a
// target attribute.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace own_kernel {

using u16 = std::uint16_t;
inline constexpr std::int64_t step = 32;           // k per TDPBF16PS
inline constexpr std::int64_t tile_elements = 512;  // 16 rows x 32 bf16: one packed tile, 1 KiB

// A matrix by its strides: element (i, j) = data[i * row + j * col]. Elements are bf16 bits
// (u16), or fp32 that the kernel takes to bf16 as it packs (see gemm).
template <class Element>
struct strided_of {
  const Element* data;
  std::int64_t row, col;
  const Element* at(std::int64_t i, std::int64_t j) const { return data + i * row + j * col; }
};
using strided = strided_of<u16>;

// Tiles 0-3 hold C's 32 x 32 block, 4-5 two 16-row tiles of A, 6-7 two 16-column tiles of B.
struct alignas(64) tile_config {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

// GCC's _tile_loadconfig names only the first 8 bytes of the configuration as
// its input, so the compiler may drop the stores to the rest: this asm names all 64.
LCE_BF16_KERNEL_TARGET inline void load_tile_config() {
  tile_config config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

// GCC's _tile_loadd is an asm that does not say it reads memory: without this
// barrier the compiler may move the packing's stores past the tile loads.
inline void packed_stores_done() { __asm__ volatile("" ::: "memory"); }

// 16 x 16 transpose of 32-bit lanes: v[r].lane(c) becomes v[c].lane(r).
LCE_BF16_KERNEL_TARGET inline void transpose_16x16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane of v[i] now holds a 4 x 4 block's row; gather the blocks.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Up to 16 bf16 from p, zeros past `count`.
LCE_BF16_KERNEL_TARGET inline __m256i load_16(const u16* p, std::int64_t count) {
  if (count >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (count <= 0) return _mm256_setzero_si256();
  return _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), p);
}

// Up to 32 bf16 from p, zeros past `count`.
LCE_BF16_KERNEL_TARGET inline __m512i load_32(const u16* p, std::int64_t count) {
  if (count >= 32) return _mm512_loadu_si512(p);
  if (count <= 0) return _mm512_setzero_si512();
  return _mm512_maskz_loadu_epi16((std::uint32_t{1} << count) - 1, p);
}

// Up to 16 floats from p, zeros past `count`.
LCE_BF16_KERNEL_TARGET inline __m512 load_16f(const float* p, std::int64_t count) {
  if (count >= 16) return _mm512_loadu_ps(p);
  if (count <= 0) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
}

// The bf16 bits of 16 floats in 32-bit lanes: round to nearest even, NaN kept and made quiet
// (the rounding of lce::bfloat16 and detail::split_to_bf16).
LCE_BF16_KERNEL_TARGET inline __m512i round_to_bf16_lanes(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// 16 floats as 16 bf16 (B's values, bf16 already: exact).
LCE_BF16_KERNEL_TARGET inline __m256i to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(round_to_bf16_lanes(x)); }

// 16 floats as two bf16 parts, hi = bf16(x) and lo = bf16(x - hi) (lo = 0 where hi is not finite).
LCE_BF16_KERNEL_TARGET inline void split_16(__m512 x, __m256i& hi, __m256i& lo) {
  const __m512i high_lanes = round_to_bf16_lanes(x);
  const __m512 high = _mm512_castsi512_ps(_mm512_slli_epi32(high_lanes, 16));
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(high, high), _mm512_setzero_ps(), _CMP_EQ_OQ);
  hi = _mm512_cvtepi32_epi16(high_lanes);
  lo = to_bf16(_mm512_maskz_sub_ps(finite, x, high));
}

// Two halves of 16 bf16 as one row of 32.
LCE_BF16_KERNEL_TARGET inline __m512i join(__m256i first, __m256i second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

// Pairs of rows (r0, r1) of 16 bf16 each as 16 32-bit lanes (r0[c], r1[c]).
LCE_BF16_KERNEL_TARGET inline __m512i interleave(__m256i r0, __m256i r1) {
  const __m512i index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(index, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
}

// One packed tile of B in VNNI form: pair rows p = 0..15 of k = k0 + 2p, 2p + 1, columns
// n0 .. n0 + 15, zeros outside [0, k) x [0, n).
LCE_BF16_KERNEL_TARGET inline void pack_b_tile(const strided& b, std::int64_t k, std::int64_t n, std::int64_t k0,
                                       std::int64_t n0, u16* out) {
  if (b.col == 1) {  // columns along memory: interleave rows k0 + 2p and k0 + 2p + 1
    for (int p = 0; p < 16; ++p) {
      const std::int64_t r = k0 + 2 * p;
      const __m256i r0 = r < k ? load_16(b.at(r, n0), n - n0) : _mm256_setzero_si256();
      const __m256i r1 = r + 1 < k ? load_16(b.at(r + 1, n0), n - n0) : _mm256_setzero_si256();
      _mm512_storeu_si512(out + p * 32, interleave(r0, r1));
    }
    return;
  }
  // Depth along memory (b.row == 1): column n0 + c's 32 k are 16 32-bit pairs; transpose them.
  __m512i v[16];
  for (int c = 0; c < 16; ++c)
    v[c] = n0 + c < n ? load_32(b.at(k0, n0 + c), k - k0) : _mm512_setzero_si512();
  transpose_16x16(v);
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + p * 32, v[p]);
}

// How many C blocks ahead gemm asks for the lines of a C it reads. The next block's lines
// came too late for a shallow block: dW of a chunk of 228 tokens (k 228, fp32 C read and
// written, V 32,000 x H 1,024) ran 354 GFLOP/s on a Zen 5 core and 704 on two, 410-420 /
// 810-817 three blocks ahead (with a_run::last_pairs; where C was added at the end of each
// block, 398-401 / 757-781 two to four ahead, 368 / 716 six), 441 / 851 with C not read.
inline constexpr std::int64_t c_blocks_ahead = 3;

// How many tiles ahead the packing asks for the lines it reads (see gemm).
inline constexpr std::int64_t packed_ahead = 8;

// The steps of packed A that the AMX unit multiplies by every panel of packed B before the
// next ones: 2 x 8 tiles, 16 KiB, stay in L1 while B's tiles stream from L2, where a whole
// depth block of A (64 KiB at 1,024) went back to L2 for each panel, and every step's four
// tile loads came from L2. The blocks of C are then added to 4 times per depth block of
// 1,024 (from L2: a row block's C is at most 32 x 1,024 fp32). A bf16 step of lce_torch (N
// 1,024, H 1,024, V 32,000, 2 threads, warm memory, without multiply_steps' prefetch) took
// 177-182 ms against 198-204 ms on a 2-core AMX Xeon; 4 steps ran slower, 16 about the same.
inline constexpr std::int64_t l1_slice_steps = 8;

// The line at p into L1. An asm: GCC 12 drops _mm_prefetch and __builtin_prefetch from
// function templates inlined into this kernel (no prefetch instruction was left in gemm).
inline void prefetch_line(const void* p) { __asm__ volatile("prefetcht0 %0" ::"m"(*static_cast<const char*>(p))); }

// The first line of the 32 k from k0 (< k) of columns n0 .. n0 + 15 of a B whose k runs along memory.
template <class Element>
inline void prefetch_columns(const strided_of<Element>& b, std::int64_t n, std::int64_t k0, std::int64_t n0) {
  for (std::int64_t c = n0; c < std::min(n, n0 + 16); ++c) prefetch_line(b.at(k0, c));
}

// The line at column n0 of the 32 rows from k0 of a B whose columns run along memory.
template <class Element>
inline void prefetch_rows(const strided_of<Element>& b, std::int64_t k, std::int64_t k0, std::int64_t n0) {
  for (std::int64_t r = k0; r < std::min(k, k0 + step); ++r) prefetch_line(b.at(r, n0));
}

// The lines of C's block of `rows` x `cols` at c (rows ldc elements apart).
template <class CElement>
inline void prefetch_block(const CElement* c, std::int64_t rows, std::int64_t cols, std::int64_t ldc) {
  const std::int64_t bytes = cols * static_cast<std::int64_t>(sizeof(CElement));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t offset = 0; offset < bytes; offset += 64)
      prefetch_line(reinterpret_cast<const char*>(c + r * ldc) + offset);
}

// One packed tile of A: rows m0 .. m0 + 15, 32 k from k0, zeros outside [0, m) x [0, k).
LCE_BF16_KERNEL_TARGET inline void pack_a_tile(const strided& a, std::int64_t m, std::int64_t k, std::int64_t m0,
                                       std::int64_t k0, u16* out) {
  if (a.col == 1) {  // k along memory: copy rows
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_si512(out + r * 32, m0 + r < m ? load_32(a.at(m0 + r, k0), k - k0) : _mm512_setzero_si512());
    return;
  }
  // Rows along memory (a.row == 1): interleave the k rows in pairs, then transpose the pairs.
  __m512i v[16];
  for (int p = 0; p < 16; ++p) {
    const std::int64_t kk = k0 + 2 * p;
    const __m256i r0 = kk < k ? load_16(a.at(m0, kk), m - m0) : _mm256_setzero_si256();
    const __m256i r1 = kk + 1 < k ? load_16(a.at(m0, kk + 1), m - m0) : _mm256_setzero_si256();
    v[p] = interleave(r0, r1);
  }
  transpose_16x16(v);
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(out + r * 32, v[r]);
}

// 32 lines of 64 bytes, `stride` elements apart from `first`, into `stage` (32 x 32, contiguous).
// Where two tiles' packing reads the two halves of the same lines (a step's 32 rows of dX's
// weight, or of dW's dz^T), and the lines are 2 or 4 KiB apart (a row of H = 1,024 in bf16, or
// dz over a 1,024-column tile's fp32 logits), the 32 lines fall in one or two of L1's sets,
// over its 12 ways: the second tile went back to L2 for the lines the first had read. Copied
// once, both tiles pack from L1.
LCE_BF16_KERNEL_TARGET inline void stage_lines(const u16* first, std::int64_t stride, u16* stage) {
  for (int r = 0; r < 32; ++r) _mm512_store_si512(stage + r * 32, _mm512_loadu_si512(first + r * stride));
}

// pack_b_tile for a B of floats holding bf16 values (dW's hidden rows, widened): rounded as packed.
LCE_BF16_KERNEL_TARGET inline void pack_b_tile(const strided_of<float>& b, std::int64_t k, std::int64_t n, std::int64_t k0,
                                       std::int64_t n0, u16* out) {
  if (b.col == 1) {
    for (int p = 0; p < 16; ++p) {
      const std::int64_t r = k0 + 2 * p;
      const __m256i r0 = r < k ? to_bf16(load_16f(b.at(r, n0), n - n0)) : _mm256_setzero_si256();
      const __m256i r1 = r + 1 < k ? to_bf16(load_16f(b.at(r + 1, n0), n - n0)) : _mm256_setzero_si256();
      _mm512_storeu_si512(out + p * 32, interleave(r0, r1));
    }
    return;
  }
  __m512i v[16];
  for (int c = 0; c < 16; ++c) {
    const float* column = b.at(k0, n0 + c);
    v[c] = n0 + c < n ? join(to_bf16(load_16f(column, k - k0)), to_bf16(load_16f(column + 16, k - k0 - 16)))
                      : _mm512_setzero_si512();
  }
  transpose_16x16(v);
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + p * 32, v[p]);
}

// pack_a_tile for an A of floats: both bf16 parts of each element, hi into `out`, lo into `lo_out`.
LCE_BF16_KERNEL_TARGET inline void pack_a_tile(const strided_of<float>& a, std::int64_t m, std::int64_t k, std::int64_t m0,
                                       std::int64_t k0, u16* out, u16* lo_out) {
  if (a.col == 1) {  // k along memory
    for (int r = 0; r < 16; ++r) {
      __m256i hi[2], lo[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 x = m0 + r < m ? load_16f(a.at(m0 + r, k0 + 16 * h), k - k0 - 16 * h) : _mm512_setzero_ps();
        split_16(x, hi[h], lo[h]);
      }
      _mm512_storeu_si512(out + r * 32, join(hi[0], hi[1]));
      _mm512_storeu_si512(lo_out + r * 32, join(lo[0], lo[1]));
    }
    return;
  }
  // Rows along memory (a.row == 1): as for bf16, each part interleaved in pairs and transposed.
  __m512i hi[16], lo[16];
  for (int p = 0; p < 16; ++p) {
    const std::int64_t kk = k0 + 2 * p;
    __m256i hi0, lo0, hi1, lo1;
    split_16(kk < k ? load_16f(a.at(m0, kk), m - m0) : _mm512_setzero_ps(), hi0, lo0);
    split_16(kk + 1 < k ? load_16f(a.at(m0, kk + 1), m - m0) : _mm512_setzero_ps(), hi1, lo1);
    hi[p] = interleave(hi0, hi1);
    lo[p] = interleave(lo0, lo1);
  }
  transpose_16x16(hi);
  transpose_16x16(lo);
  for (int r = 0; r < 16; ++r) {
    _mm512_storeu_si512(out + r * 32, hi[r]);
    _mm512_storeu_si512(lo_out + r * 32, lo[r]);
  }
}

// C's 32 x 32 block in tiles 0-3 from or to fp32 rows `ld` floats apart.
LCE_BF16_KERNEL_TARGET inline void load_c_tiles(const float* from, std::int64_t ld) {
  _tile_loadd(0, from, ld * 4);
  _tile_loadd(1, from + 16, ld * 4);
  _tile_loadd(2, from + 16 * ld, ld * 4);
  _tile_loadd(3, from + 16 * ld + 16, ld * 4);
}

LCE_BF16_KERNEL_TARGET inline void store_c_tiles(float* to, std::int64_t ld) {
  _tile_stored(0, to, ld * 4);
  _tile_stored(1, to + 16, ld * 4);
  _tile_stored(2, to + 16 * ld, ld * 4);
  _tile_stored(3, to + 16 * ld + 16, ld * 4);
}

// Where the kernel reads the two 16-row tiles of A at step s: a[h] + s * advance, rows `stride` bytes apart.
struct a_tiles {
  const u16* half[2];
  std::int64_t advance, stride;
};

// Whether this CPU has AVX512-BF16's conversions (every AMX Xeon has; cpuid says so).
inline bool cpu_converts_to_bf16() {
  static const bool converts = x86_bf16_features::read().avx512_bf16();
  return converts;
}

// 16 bf16 (bits) as floats, exactly.
LCE_BF16_KERNEL_TARGET inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 32 floats, low then high, as 32 bf16 rounded as round_to_bf16_lanes rounds (to nearest even,
// NaN made quiet): by VCVTNE2PS2BF16, which takes 2 instructions where that takes 11 a vector,
// unless a lane is subnormal, which the instruction flushes to zero and lce::bfloat16 keeps.
// Rounding dW's tiles into a bf16 C, the instruction took dW of 512 tokens (H 1,024, V 32,000,
// one AMX core) from 57-61 ms to 51-54 ms.
LCE_BF16_KERNEL_TARGET inline __m512i to_bf16_pair(__m512 low, __m512 high) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), magnitude = _mm512_set1_epi32(0x7fffffff);
  const __m512i low_bits = _mm512_castps_si512(low), high_bits = _mm512_castps_si512(high);
  const __mmask16 subnormal_low =
      _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(low_bits, exponent), low_bits, magnitude);
  const __mmask16 subnormal_high =
      _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(high_bits, exponent), high_bits, magnitude);
  if ((subnormal_low | subnormal_high) != 0) return join(to_bf16(low), to_bf16(high));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

// Rows first_row .. end_row - 1 of C[0:rows, 0:cols] = bf16(alpha block + beta C), C bf16 (u16
// bits), beta 0 (C not read) or 1, block 32 x 32 row-major: each element widened, added to in
// fp32 and rounded once, as detail::add_span adds an fp32 sum into a bfloat16 span (so the two
// give the same bits).
LCE_BF16_KERNEL_TARGET inline void round_block_rows_into(const float* block, std::int64_t first_row,
                                                         std::int64_t end_row, std::int64_t cols, float alpha,
                                                         float beta, u16* c, std::int64_t ldc) {
  const __m512 va = _mm512_set1_ps(alpha);
  if (cols == 32 && cpu_converts_to_bf16()) {
    for (std::int64_t r = first_row; r < end_row; ++r) {
      __m512 low = _mm512_loadu_ps(block + r * 32), high = _mm512_loadu_ps(block + r * 32 + 16);
      if (alpha != 1.0f) low = _mm512_mul_ps(va, low), high = _mm512_mul_ps(va, high);
      u16* const out = c + r * ldc;
      if (beta != 0.0f) {
        const __m512i old = _mm512_loadu_si512(out);
        low = _mm512_add_ps(widen_bf16(_mm512_castsi512_si256(old)), low);
        high = _mm512_add_ps(widen_bf16(_mm512_extracti64x4_epi64(old, 1)), high);
      }
      _mm512_storeu_si512(out, to_bf16_pair(low, high));
    }
    return;
  }
  for (std::int64_t r = first_row; r < end_row; ++r) {
    for (std::int64_t j = 0; j < cols; j += 16) {
      const std::int64_t left = cols - j;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1);
      __m512 v = _mm512_loadu_ps(block + r * 32 + j);
      if (alpha != 1.0f) v = _mm512_mul_ps(va, v);
      u16* const out = c + r * ldc + j;
      if (beta != 0.0f) v = _mm512_add_ps(widen_bf16(_mm256_maskz_loadu_epi16(mask, out)), v);
      _mm256_mask_storeu_epi16(out, mask, to_bf16(v));
    }
  }
}

// A finished block of a bf16 C, rounded into C a few rows at a time between the next block's
// steps on the tiles, so that this vector work runs while the tiles multiply. Rounded right
// after its own products, each block's rounding waited for its tile stores, and the tiles
// idled until it was done: dW of 512 tokens into a bf16 C (H 1,024, V 32,000, one AMX
// core) took 54-56 ms so, against 49 ms spread (the bits are the same).
struct deferred_rounding {
  const float* block = nullptr;
  std::int64_t rows = 0, cols = 0, done = 0;
  float alpha = 1.0f, beta = 0.0f;
  u16* c = nullptr;
  std::int64_t ldc = 0;

  LCE_BF16_KERNEL_TARGET void round_rows(std::int64_t count) {
    const std::int64_t end = std::min(rows, done + count);
    round_block_rows_into(block, done, end, cols, alpha, beta, c, ldc);
    done = end;
  }
  LCE_BF16_KERNEL_TARGET void finish() { round_rows(rows - done); }
  // Rows per step that finish the block within `steps` steps.
  std::int64_t rows_per_step(std::int64_t steps) const { return steps > 0 ? (rows - done + steps - 1) / steps : 0; }
};

// C tiles 0-3 += A(steps) x B(steps); b0, b1 packed (consecutive tiles per step). No
// software prefetch: the 64 prefetches a step took the load ports the tile loads need. On a
// 2-core AMX Xeon (model 167) the loop ran 1.57 TFLOP/s on one core with them, 2.10 without
// (A and B in L1), and a bf16 step of lce_torch (N 1,024, H 1,024, V 32,000, 2 threads,
// warm memory) 198-204 ms without against 214-216 ms with. `pending`, where given, is rounded
// into its C `rows_per_step` rows after each step.
LCE_BF16_KERNEL_TARGET inline void multiply_steps(const a_tiles& a, const u16* b0, const u16* b1, std::int64_t steps,
                                                  deferred_rounding* pending, std::int64_t rows_per_step) {
  for (std::int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, b0 + s * tile_elements, 64);
    _tile_loadd(4, a.half[0] + s * a.advance, a.stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * tile_elements, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a.half[1] + s * a.advance, a.stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (pending) pending->round_rows(rows_per_step);
  }
}

// A run of `steps` steps of A's 32-row block against packed B's steps from `first_step` on.
// `last_pairs`: the pairs (k, k + 1) of its last step that hold any k < K, where the depth
// block ends in a ragged step. AVX512-BF16 stops there (the rest are zeros in both
// operands); AMX tiles always take the whole step.
struct a_run {
  a_tiles a;
  std::int64_t first_step, steps;
  int last_pairs = 16;
};

// C's 32 x 32 block `to` (rows ld_to floats apart) = `from` (or zero where null) plus the
// products of every run, on AMX tiles 0-3; the block `pending`, where given, rounded into its C
// meanwhile.
LCE_BF16_KERNEL_TARGET inline void block_product_on_tiles(const a_run* runs, int count, const u16* b0, const u16* b1,
                                                  const float* from, std::int64_t ld_from, float* to,
                                                  std::int64_t ld_to, deferred_rounding* pending) {
  if (from) {
    load_c_tiles(from, ld_from);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  std::int64_t steps = 0;
  for (int r = 0; r < count; ++r) steps += runs[r].steps;
  const std::int64_t rows_per_step = pending ? pending->rows_per_step(steps) : 0;
  for (int r = 0; r < count; ++r)
    multiply_steps(runs[r].a, b0 + runs[r].first_step * tile_elements, b1 + runs[r].first_step * tile_elements,
                   runs[r].steps, pending, rows_per_step);
  if (pending) pending->finish();
  store_c_tiles(to, ld_to);
}

// The first `pairs` pairs (Pairs where > 0) of step s of run `in` into rows row0 .. row0 +
// Rows - 1 of the block's accumulators (see rows_product_on_vectors): whole steps (Pairs =
// 16) fully unrolled; a ragged last step loops over its pairs, so that a depth of 228 (dW of a
// chunk of 228 tokens) runs 114 pairs, not the 128 of 8 whole steps.
template <int Rows, int Pairs>
__attribute__((always_inline)) LCE_BF16_KERNEL_TARGET inline void add_pairs(const a_run& in, std::int64_t s, int pairs,
                                                                            const u16* b0, const u16* b1, int row0,
                                                                            __m512 (&left)[Rows], __m512 (&right)[Rows]) {
  const u16* const bl = b0 + (in.first_step + s) * tile_elements;
  const u16* const br = b1 + (in.first_step + s) * tile_elements;
  const char* a_row[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r)
    a_row[r] = reinterpret_cast<const char*>(in.a.half[(row0 + r) / 16] + s * in.a.advance) +
               ((row0 + r) % 16) * in.a.stride;
  if constexpr (Pairs > 0) pairs = Pairs;
#pragma GCC unroll 16
  for (int pair = 0; pair < pairs; ++pair) {
    const __m512bh vl = (__m512bh)_mm512_load_si512(bl + 32 * pair);
    const __m512bh vr = (__m512bh)_mm512_load_si512(br + 32 * pair);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      std::int32_t both;
      std::memcpy(&both, a_row[r] + 4 * pair, sizeof both);
      const __m512bh va = (__m512bh)_mm512_set1_epi32(both);
      left[r] = _mm512_dpbf16_ps(left[r], va, vl);
      right[r] = _mm512_dpbf16_ps(right[r], va, vr);
    }
  }
}

// Rows row0 .. row0 + Rows - 1 of the block on AVX512-BF16: each VDPBF16PS adds, for 16
// columns of one packed B pair row, the products of a pair (k, k + 1) of one row of A
// broadcast to every lane: 2 x Rows accumulators over the 32 columns, the pair's two B
// vectors loaded once for all the rows. Each product of bf16 values is exact in fp32 and
// each sum an fp32 sum, as on the tiles (the order of the sums differs).
//
// Never inlined: inlined into the GEMM that rounds into a bf16 C, one accumulator went to the
// stack and back at every VDPBF16PS (dW into bf16 at 258 GFLOP/s on a Zen 5 core, against
// 353 into fp32).
template <int Rows>
__attribute__((noinline)) LCE_BF16_KERNEL_TARGET void rows_product_on_vectors(
    const a_run* runs, int count, const u16* b0, const u16* b1, int row0, const float* from, std::int64_t ld_from,
    float* to, std::int64_t ld_to) {
  // Every loop over the rows unrolled, so that the accumulators and row pointers stay in
  // registers (-O2 alone left the pointers in memory: 380 against 450 GFLOP/s on a Zen 5 core).
  __m512 left[Rows], right[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    left[r] = from ? _mm512_loadu_ps(from + (row0 + r) * ld_from) : _mm512_setzero_ps();
    right[r] = from ? _mm512_loadu_ps(from + (row0 + r) * ld_from + 16) : _mm512_setzero_ps();
  }
  for (int run = 0; run < count; ++run) {
    const a_run& in = runs[run];
    const std::int64_t whole = in.last_pairs < 16 ? in.steps - 1 : in.steps;
    for (std::int64_t s = 0; s < whole; ++s) add_pairs<Rows, 16>(in, s, 16, b0, b1, row0, left, right);
    if (whole < in.steps) add_pairs<Rows, 0>(in, whole, in.last_pairs, b0, b1, row0, left, right);
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(to + (row0 + r) * ld_to, left[r]);
    _mm512_storeu_ps(to + (row0 + r) * ld_to + 16, right[r]);
  }
}

// The block on AVX512-BF16, its first `rows` rows rounded up to 8 (a block of C holds 32).
LCE_BF16_KERNEL_TARGET inline void block_product_on_vectors(const a_run* runs, int count, const u16* b0, const u16* b1,
                                                    std::int64_t rows, const float* from, std::int64_t ld_from,
                                                    float* to, std::int64_t ld_to) {
  constexpr int group = 8;
  for (int row0 = 0; row0 < rows; row0 += group)
    rows_product_on_vectors<group>(runs, count, b0, b1, row0, from, ld_from, to, ld_to);
}

// C[0:rows, 0:cols] = alpha block + beta C (beta = 0: C is not read), block 32 x 32 row-major.
LCE_BF16_KERNEL_TARGET inline void add_block(const float* block, std::int64_t rows, std::int64_t cols, float alpha, float beta,
                                     float* c, std::int64_t ldc) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; j += 16) {
      const std::int64_t left = cols - j;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1);
      __m512 v = _mm512_mul_ps(va, _mm512_loadu_ps(block + r * 32 + j));
      float* const out = c + r * ldc + j;
      if (beta != 0.0f) v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask, out), v);
      _mm512_mask_storeu_ps(out, mask, v);
    }
  }
}

// Scratch of this thread's, grown to the largest call and kept (left uninitialised: the
// pages a call does not touch are never mapped), 4 KiB-aligned so that packed tiles sit
// on whole cache lines and their L1 sets are known (see gemm). Slot 0 holds packed B,
// slot 1 packed A; `bytes` says how much this thread holds.
struct thread_scratch {
  template <int Slot>
  static u16* get(std::size_t elements) {
    slot& s = slots()[Slot];
    const std::size_t bytes = (elements * sizeof(u16) + 4095) / 4096 * 4096;
    if (s.bytes < bytes) {
      s.memory.reset();
      s.bytes = 0;
      s.memory.reset(std::aligned_alloc(4096, bytes));
      if (!s.memory) throw std::bad_alloc();
      s.bytes = bytes;
    }
    return static_cast<u16*>(s.memory.get());
  }

  static std::size_t bytes() { return slots()[0].bytes + slots()[1].bytes; }

 private:
  struct aligned_free {
    void operator()(void* p) const { std::free(p); }
  };
  struct slot {
    std::unique_ptr<void, aligned_free> memory;
    std::size_t bytes = 0;
  };
  static std::array<slot, 2>& slots() {
    thread_local std::array<slot, 2> held;
    return held;
  }
};

// Packed B's columns are capped so that it and packed A stay within this per thread,
// whatever the shapes (own_bf16_gemm_scratch_bytes).
inline constexpr std::int64_t packed_b_bytes_max = 1088 * 1024;
// The deepest k that a bf16 C takes (one depth block, so that each element's sum is rounded once).
inline constexpr std::int64_t max_depth = 1024;
inline constexpr std::int64_t kib = 512;  // u16 elements in 1 KiB

// How one call is cut: depth blocks of `depth` k (a multiple of 32) and column blocks of
// `columns` (a multiple of 32). Packed B is columns x depth; A's rows, when read in
// place, are re-read once per column block, and C once per depth block. Each 16-column
// stream of packed tiles is `stream` elements, padded to whole 4 KiB so that streams
// start 1 KiB apart modulo 4 KiB: A halves at 0 and 1 KiB, B's column pairs at 2 and 3
// KiB, and the four tiles of a step fall in different L1 sets. `pair_stride` is the
// elements of one 32-column panel of packed B (two streams and the 1 KiB offsets).
struct blocking {
  std::int64_t depth, columns, stream, pair_stride;

  static constexpr std::int64_t packed_b_target = std::int64_t{1} << 19;  // elements: 1 MiB of packed B
  static constexpr std::int64_t c_in_l2 = std::int64_t{1} << 18;          // fp32 elements of C: 1 MiB

  static blocking choose(std::int64_t m, std::int64_t n, std::int64_t k, bool a_in_place, bool one_depth_block = false) {
    const std::int64_t n32 = (n + 31) / 32 * 32, k32 = (k + step - 1) / step * step;
    std::int64_t depth = 0, columns = 0;
    if (one_depth_block) {
      // A bf16 C is rounded once, from the whole sum (k <= max_depth): all of k in one
      // block, as many columns as 1 MiB of packed B holds.
      depth = k32;
      columns = std::clamp<std::int64_t>(packed_b_target / depth / 32 * 32, 32, n32);
    } else if (!a_in_place) {
      // A is packed per row block and column block: as many columns as 1 MiB of packed B
      // holds, so that A is packed once for all of them where it can be.
      depth = std::min<std::int64_t>(k32, 1024);
      // A is packed again for every column block: where a depth of 512 lets one block hold
      // all the columns and C stays in L2 (1 MiB) between the two depth blocks, take that,
      // so that A is packed once. dW's 256-row tiles in the vocabulary order (dz^T,
      // transposed as packed, against H = 1,024 columns, 1,024 tokens deep) had it packed
      // twice, 7% of a bf16 step through lce_torch at N 1,024, V 32,000 (with the logits'
      // 1 x 2 tiles: 0.176 s against 0.185 s on 2 threads, warm memory); a C of 4 MiB
      // (1,002-row dW tiles at V 128,256) took 17% longer in two depth blocks.
      if (depth == 1024 && packed_b_target / 1024 < n32 && packed_b_target / 512 >= n32 && m * n32 <= c_in_l2)
        depth = 512;
      columns = std::clamp<std::int64_t>(packed_b_target / depth / 32 * 32, 32, n32);
    } else if (k32 <= 1024) {
      // A read in place. Up to 1,024 deep, one depth block (C written once: the logits' C is
      // larger than the caches) and 128 K elements of packed B (256 KiB, in L2).
      depth = k32;
      columns = std::clamp<std::int64_t>((std::int64_t{1} << 17) / k32 / 32 * 32, 32, n32);
    } else {
      // Deeper (dX: the whole vocabulary against one [rows, 512] piece of dX, which stays in
      // L2), blocks of 1,024 k across 512 columns, so that A, from memory, is read once. Each
      // depth block stores and reloads C's tiles, which drains the multiplier: at depth
      // 32,000, [512, 512] of dX took 43 ms in blocks of 256 k, 32 in blocks of 512 and 28 in
      // blocks of 1,024.
      depth = 1024;
      columns = std::min<std::int64_t>(512, n32);
    }
    const std::int64_t stream = (depth / step * kib + 4 * kib - 1) / (4 * kib) * (4 * kib);
    const std::int64_t pair_stride = 2 * stream + 4 * kib;
    // Shallow blocks pad each stream to 4 KiB: cap the panels by their padded bytes.
    const std::int64_t panels_max = std::max<std::int64_t>(1, packed_b_bytes_max / 2 / pair_stride);
    return {depth, std::min(columns, 32 * panels_max), stream, pair_stride};
  }

  std::int64_t packed_b_elements() const { return columns / 32 * pair_stride; }
  std::int64_t packed_a_elements() const { return 2 * stream + 2 * kib; }
};

// C[m, n] = alpha A[m, k] B[k, n] + beta C, A and B by their strides, C row-major with ldc.
// A of floats is taken as two bf16 parts, hi + lo, each multiplied by the same packed B
// (split); B of floats must hold bf16 values (rounded as packed). A C of bf16 (u16 bits) gets
// bf16(alpha A B + beta C), beta 0 or 1, and needs k <= max_depth.
template <bf16_unit Unit, class AElement, class BElement, class CElement = float>
LCE_BF16_KERNEL_TARGET inline void gemm(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, strided_of<AElement> a,
                                strided_of<BElement> b, float beta, CElement* c, std::int64_t ldc) {
  constexpr bool split = std::is_same_v<AElement, float>;
  constexpr bool rounds_into_bf16 = std::is_same_v<CElement, u16>;
  // A is read in place when k runs along memory, unless, on AMX, its rows alias in L1: at a
  // row stride that is a multiple of 512 bytes (H = 1,024 in bf16 is 2 KiB) a tile's 16 rows
  // fall in at most 8 of L1's 64 sets, and two tiles overflow its 12 ways. Packed, the
  // vocabulary order's [1,024, 1,024] logits at depth 1,024 ran 1,002-1,059 GFLOP/s on
  // one thread instead of 575-619. The vector unit reads 8 rows a step, one line each, which
  // no stride puts over 12 ways: in place, dX of 256 tokens (dz's rows 62.5 KiB apart at
  // V 32,000) ran 3.5% faster on a Zen 5 core. A split A is always packed.
  bool a_in_place = false;
  if constexpr (!split) a_in_place = a.col == 1 && (Unit == bf16_unit::avx512 || (a.row * 2) % 512 != 0);
  const blocking cut = blocking::choose(m, n, k, a_in_place, rounds_into_bf16);
  const std::int64_t panels = cut.columns / 32;
  // Whole 32 x 32 blocks of C with alpha = 1 and beta 0 or 1 go to and from the tiles as they
  // are; other blocks (ragged edges, alpha != 1) go through `block` and are added into C
  // after each depth block (alpha times the block's sum, plus beta C after the first).
  const bool c_in_place_allowed = !rounds_into_bf16 && alpha == 1.0f && (beta == 0.0f || beta == 1.0f);
  u16* const b_pack = thread_scratch::get<0>(static_cast<std::size_t>(cut.packed_b_elements()));
  // A row of C's blocks summed slice by slice (l1_slice_steps, below) keeps its blocks' sums
  // between slices in scratch, each block's 32 x 32 floats contiguous, and reads and writes C
  // once: C's own rows, 4 KiB apart for the logits and dX of a 1,024-column tile, put a tile's
  // 16 lines in one L1 set, and a row of C's blocks and packed B outgrew L2 between slices.
  // On one AMX core (model 167), [512, 512] of C at depth 1,024 with hot operands took
  // 0.58-0.60 ms against 0.68-0.70 for the logits, 0.68-0.70 against 0.74-0.82 for dX. The
  // sums take the room a split A's lo part takes, after packed A, where they fit there (up to
  // 512 columns at depth 1,024), so that the scratch bound holds.
  const bool may_slice = Unit == bf16_unit::amx && !split && c_in_place_allowed && cut.depth > l1_slice_steps * step;
  const std::int64_t sums_offset = (cut.packed_a_elements() + 4 * kib - 1) / (4 * kib) * (4 * kib);
  const std::int64_t sums_elements = 32 * cut.columns * 2;  // u16 elements
  const bool sums_in_scratch = may_slice && sums_offset + sums_elements <= cut.packed_a_elements() + cut.pair_stride;
  // A split: lo's two halves one panel stride after hi's, at the same offsets modulo 4 KiB.
  u16* const a_pack = thread_scratch::get<1>(static_cast<std::size_t>(
      split ? cut.pair_stride + cut.packed_a_elements()
            : (sums_in_scratch ? sums_offset + sums_elements : cut.packed_a_elements())));
  float* const slice_sums = sums_in_scratch ? reinterpret_cast<float*>(a_pack + sums_offset) : nullptr;
  const auto b_stream = [&](std::int64_t j) {  // the packed tiles of B's columns 16 j .. 16 j + 15
    return b_pack + j / 2 * cut.pair_stride + 2 * kib + (j % 2) * (cut.stream + kib);
  };
  u16* const a_half[2] = {a_pack, a_pack + cut.stream + kib};
  u16* const a_lo_half[2] = {a_half[0] + cut.pair_stride, a_half[1] + cut.pair_stride};
  // Blocks of C that go through a buffer: two, so that on AMX a bf16 C's block is rounded in
  // while the next one multiplies (deferred_rounding; the vector unit rounds each at once).
  alignas(64) float blocks[2][32 * 32];
  int next_buffer = 0;
  deferred_rounding pending_rounding;

  if constexpr (Unit == bf16_unit::amx) load_tile_config();
  for (std::int64_t n0 = 0; n0 < n; n0 += cut.columns) {
    const std::int64_t these_panels = std::min(panels, (n - n0 + 31) / 32);
    for (std::int64_t k0 = 0; k0 < k; k0 += cut.depth) {
      const std::int64_t kb = std::min(cut.depth, k - k0);
      const std::int64_t steps = (kb + step - 1) / step, full_steps = kb / step;
      // The pairs of the last step that hold any k (16 where the block ends on a whole step).
      const int last_pairs = full_steps < steps ? static_cast<int>((kb - full_steps * step + 1) / 2) : 16;
      const bool first = k0 == 0;
      const bool reads_c = !first || beta != 0.0f;
      // Along memory: each row of B (the rows of a column-contiguous B, else its columns) in one pass.
      if (b.col == 1) {
        // 32 rows at a time (a step's k), 16 columns each: the next step's rows are asked for
        // tile by tile, a whole step ahead (the prefetchers do not follow 32 streams either).
        // A whole step of 32 bf16 columns (two tiles) is staged first (stage_lines).
        for (std::int64_t s = 0; s < steps; ++s)
          for (std::int64_t p = 0; p < 2 * these_panels; p += 2) {
            const std::int64_t kk = k0 + s * step, col = n0 + p * 16;
            prefetch_rows(b, k, kk + step, col);
            prefetch_rows(b, k, kk + step, col + 16);
            bool staged_pair = false;
            if constexpr (std::is_same_v<BElement, u16>) {
              if (kk + step <= k && col + 32 <= n) {
                alignas(64) u16 stage[32 * 32];
                stage_lines(b.at(kk, col), b.row, stage);
                const strided staged{stage, 32, 1};
                pack_b_tile(staged, 32, 32, 0, 0, b_stream(p) + s * tile_elements);
                pack_b_tile(staged, 32, 32, 0, 16, b_stream(p + 1) + s * tile_elements);
                staged_pair = true;
              }
            }
            if (!staged_pair) {
              pack_b_tile(b, k, n, kk, col, b_stream(p) + s * tile_elements);
              pack_b_tile(b, k, n, kk, col + 16, b_stream(p + 1) + s * tile_elements);
            }
          }
      } else {
        // 16 columns at a time, each read along memory from its own row of the operand: the
        // lines packed_ahead tiles on are asked for first (the hardware prefetchers do not follow
        // 16 streams 2 KiB apart: the logits' weight packed at 5 GB/s without, 16 with).
        const std::int64_t tiles = 2 * these_panels * steps;
        for (std::int64_t t = 0; t < tiles; ++t) {
          const std::int64_t p = t / steps, s = t % steps;
          if (const std::int64_t next = t + packed_ahead; next < tiles)
            prefetch_columns(b, n, k0 + next % steps * step, n0 + next / steps * 16);
          pack_b_tile(b, k, n, k0 + s * step, n0 + p * 16, b_stream(p) + s * tile_elements);
        }
      }
      packed_stores_done();
      for (std::int64_t m0 = 0; m0 < m; m0 += 32) {
        const std::int64_t rows = std::min<std::int64_t>(32, m - m0);
        const bool direct = a_in_place && rows == 32;
        a_tiles in_place{};
        if constexpr (split) {
          for (int h = 0; h < 2; ++h)
            for (std::int64_t s = 0; s < steps; ++s)
              pack_a_tile(a, m, k, m0 + 16 * h, k0 + s * step, a_half[h] + s * tile_elements,
                          a_lo_half[h] + s * tile_elements);
        } else if (direct) {
          in_place = {{a.at(m0, k0), a.at(m0 + 16, k0)}, step, a.row * 2};
          if (full_steps < steps)  // the ragged last step, zero-padded
            for (int h = 0; h < 2; ++h)
              pack_a_tile(a, m, k, m0 + 16 * h, k0 + full_steps * step, a_half[h]);
        } else {
          // Step by step, both halves: a line of a transposed A (dW's dz^T) holds a k's 32 rows,
          // both halves' 16. Half by half, the second half went back to L2 for the lines the first
          // had read (dW of 512 tokens, H 1,024, V 32,000, one AMX core: 52-53 ms against 49-52
          // step by step); a whole step of 32 rows is now staged first (stage_lines).
          for (std::int64_t s = 0; s < steps; ++s) {
            const std::int64_t kk = k0 + s * step;
            if (a.row == 1 && rows == 32 && kk + step <= k) {
              alignas(64) u16 stage[32 * 32];
              stage_lines(a.at(m0, kk), a.col, stage);
              const strided staged{stage, 1, 32};
              for (int h = 0; h < 2; ++h) pack_a_tile(staged, 32, 32, 16 * h, 0, a_half[h] + s * tile_elements);
            } else {
              for (int h = 0; h < 2; ++h) pack_a_tile(a, m, k, m0 + 16 * h, kk, a_half[h] + s * tile_elements);
            }
          }
        }
        packed_stores_done();
        const a_tiles packed{{a_half[0], a_half[1]}, direct ? 0 : tile_elements, 64};
        // Slices of packed A held in L1 (l1_slice_steps) where every block of this row of C
        // takes its sums in place, so that a slice's partial sums wait there (or in
        // slice_sums). Not for a split A:
        // its hi and lo parts would then alternate slice by slice, another order of the sums
        // than the bf16 C's (one depth block, not sliced), whose bits must be the fp32 C's
        // rounded; nor did slicing speed it up (its packing bounds it).
        const bool sliced = Unit == bf16_unit::amx && !direct && !split && c_in_place_allowed && rows == 32 &&
                            n - n0 >= 32 * these_panels && steps > l1_slice_steps;
        const std::int64_t slice = sliced ? l1_slice_steps : steps;
        for (std::int64_t s0 = 0; s0 < steps; s0 += slice) {
          const std::int64_t slice_steps = std::min(slice, steps - s0);
          // A's runs for this slice, the same for every panel of B.
          a_run runs[2];
          int count = 0;
          if (direct) {
            runs[count++] = {in_place, 0, full_steps};
            if (full_steps < steps) runs[count++] = {packed, full_steps, 1, last_pairs};  // from a_half, advance 0
          } else {
            const a_tiles slice_of_a{{a_half[0] + s0 * tile_elements, a_half[1] + s0 * tile_elements},
                                     tile_elements, 64};
            runs[count++] = {slice_of_a, s0, slice_steps, s0 + slice_steps == steps ? last_pairs : 16};
            if constexpr (split)
              runs[count++] = {{{a_lo_half[0], a_lo_half[1]}, tile_elements, 64}, 0, steps, last_pairs};
          }
          for (std::int64_t p = 0; p < these_panels; ++p) {
            const std::int64_t col = n0 + p * 32;
            // The C block c_blocks_ahead on, where C is read: from memory (dW's C is 4 MiB) it
            // held the multiplier up at the start of every block (dW of 512 tokens added into a
            // bf16 C: 102 ms without, 79 ms with the next block's, on a Zen 5 core).
            if (reads_c && s0 == 0) {
              const std::int64_t ahead = p + c_blocks_ahead;
              const std::int64_t next_m0 = m0 + 32 * (ahead / these_panels);
              const std::int64_t next_col = n0 + 32 * (ahead % these_panels);
              if (next_m0 < m)
                prefetch_block(c + next_m0 * ldc + next_col, std::min<std::int64_t>(32, m - next_m0),
                               std::min<std::int64_t>(32, n - next_col), ldc);
            }
            const bool c_in_place = c_in_place_allowed && rows == 32 && n - col >= 32;
            CElement* const c_block = c + m0 * ldc + col;
            // In place, the block starts from C's sum so far (beta = 1, or a later depth block);
            // otherwise from zero, this depth block's sum going through `block`.
            const bool from_c = c_in_place && (s0 > 0 || !first || beta == 1.0f);
            float* const block = blocks[next_buffer];
            const u16* const b0 = b_stream(2 * p);
            const u16* const b1 = b_stream(2 * p + 1);
            float* const sum_to = c_in_place ? reinterpret_cast<float*>(c_block) : block;
            const std::int64_t sum_ld = c_in_place ? ldc : 32;
            const float* const sum_from = from_c ? sum_to : nullptr;
            const std::int64_t cols = std::min<std::int64_t>(32, n - col);
            // Sliced with the sums in scratch: from C (where it is read) at the first slice, to C
            // at the last, through the block's sums in between.
            float* const partial = sliced && slice_sums ? slice_sums + p * 32 * 32 : nullptr;
            const bool from_partial = partial && s0 > 0, to_partial = partial && s0 + slice_steps < steps;
            if constexpr (Unit == bf16_unit::amx)
              block_product_on_tiles(runs, count, b0, b1, from_partial ? partial : sum_from, from_partial ? 32 : sum_ld,
                                     to_partial ? partial : sum_to, to_partial ? 32 : sum_ld,
                                     rounds_into_bf16 ? &pending_rounding : nullptr);
            else
              block_product_on_vectors(runs, count, b0, b1, rows, sum_from, sum_ld, sum_to, sum_ld);
            if constexpr (rounds_into_bf16) {
              // On the tiles, rounded in while the next block multiplies; on the vector unit,
              // whose registers the products hold, now.
              pending_rounding = {block, rows, cols, 0, alpha, beta, c_block, ldc};
              if constexpr (Unit == bf16_unit::avx512) pending_rounding.finish();
              next_buffer ^= 1;
            } else if (!c_in_place) {
              add_block(block, rows, cols, alpha, first ? beta : 1.0f, c_block, ldc);
            }
          }
        }
      }
    }
  }
  pending_rounding.finish();
  if constexpr (Unit == bf16_unit::amx) _tile_release();
}

// The most packed A takes: two streams of a 1,024-deep block and their offsets, twice for a
// split A (hi at a panel stride from lo), in 4 KiB.
inline constexpr std::int64_t packed_a_bytes_max =
    (2 * ((2 * (1024 / step) * kib + 4 * kib) + 2 * (1024 / step) * kib + 2 * kib) + 4095) / 4096 * 4096;

}  // namespace own_kernel

// The most scratch the kernel holds on a thread that has called it, whatever the shapes:
// packed B and packed A, grown to the largest call and kept (reused) for the thread's life,
// as a BLAS keeps its own buffers. 1,224 KiB; C is never copied.
inline constexpr std::size_t own_bf16_gemm_scratch_bytes =
    static_cast<std::size_t>(own_kernel::packed_b_bytes_max + own_kernel::packed_a_bytes_max);

// What the kernel holds on the calling thread now.
inline std::size_t own_bf16_gemm_thread_scratch_bytes() { return own_kernel::thread_scratch::bytes(); }

namespace own_kernel {

// C = beta C, for an empty depth.
template <class CElement>
void scale_by_beta(std::int64_t m, std::int64_t n, float beta, CElement* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      c[i * ldc + j] = beta == 0.0f ? CElement(0.0f) : CElement(beta * static_cast<float>(c[i * ldc + j]));
}

template <class Element, class Given>
strided_of<Element> view_of(transpose t, const Given* data, std::int64_t ld) {
  const auto* d = reinterpret_cast<const Element*>(data);
  return t == transpose::no ? strided_of<Element>{d, ld, 1} : strided_of<Element>{d, 1, ld};
}

template <class AElement, class BElement, class CElement>
void gemm_on(bf16_unit unit, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, strided_of<AElement> a,
             strided_of<BElement> b, float beta, CElement* c, std::int64_t ldc) {
  if (unit == bf16_unit::amx)
    gemm<bf16_unit::amx>(m, n, k, alpha, a, b, beta, c, ldc);
  else
    gemm<bf16_unit::avx512>(m, n, k, alpha, a, b, beta, c, ldc);
}

// bf16 bits as the kernel reads them: u16 for bfloat16, float as it is.
template <class Element>
using bits_of = std::conditional_t<std::same_as<Element, float>, float, std::uint16_t>;

}  // namespace own_kernel

// Row-major C[m, n] = alpha op(A) op(B) + beta C on `unit` (own_bf16_gemm_available(unit) must
// hold); beta = 0 overwrites C. The provider contract's bf16_gemm.
inline void own_bf16_gemm(bf16_unit unit, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                          std::int64_t k, float alpha, const bfloat16* a, std::int64_t lda, const bfloat16* b,
                          std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return own_kernel::scale_by_beta(m, n, beta, c, ldc);
  own_kernel::gemm_on(unit, m, n, k, alpha, own_kernel::view_of<std::uint16_t>(ta, a, lda),
                      own_kernel::view_of<std::uint16_t>(tb, b, ldb), beta, c, ldc);
}

// Row-major C[m, n] = alpha (hi(A) + lo(A)) op(B) + beta C on `unit`, A in fp32 taken to
// 16 significant bits as two bf16 parts, hi = bf16(a) and lo = bf16(a - hi) (as
// detail::split_to_bf16), each multiplied by B in bf16; every sum in fp32. B is bf16, or
// fp32 holding bf16 values (rounded to nearest as it is packed). For a bfloat16 weight's dX
// (dz W) and dW (dz^T X) with dz kept to 16 bits, without splitting dz in a pass of its own.
template <class BElement>
  requires std::same_as<BElement, bfloat16> || std::same_as<BElement, float>
inline void own_split_bf16_gemm(bf16_unit unit, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                                std::int64_t k, float alpha, const float* a, std::int64_t lda, const BElement* b,
                                std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return own_kernel::scale_by_beta(m, n, beta, c, ldc);
  using B = own_kernel::bits_of<BElement>;
  own_kernel::gemm_on(unit, m, n, k, alpha, own_kernel::view_of<float>(ta, a, lda),
                      own_kernel::view_of<B>(tb, b, ldb), beta, c, ldc);
}

// bf16 C[m, n] = bf16(alpha op(A) op(B) + beta C) on `unit`, beta 0 (C is not read) or 1:
// each element's products summed in fp32 (in one depth block up to own_kernel::max_depth),
// times alpha, added to C widened to fp32 and rounded once to nearest even (the bits of this
// kernel's fp32 C with beta 0 followed by detail::add_span, or by a rounding copy). For dW
// tiles straight into a bf16 grad_weight, without an fp32 tile.
// A is bf16, or fp32 split as hi + lo (as own_split_bf16_gemm); B bf16, or fp32 holding
// bf16 values.
template <class AElement, class BElement>
  requires(std::same_as<AElement, bfloat16> || std::same_as<AElement, float>) &&
          (std::same_as<BElement, bfloat16> || std::same_as<BElement, float>)
inline void own_bf16_gemm_into_bf16(bf16_unit unit, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                                    std::int64_t k, float alpha, const AElement* a, std::int64_t lda,
                                    const BElement* b, std::int64_t ldb, float beta, bfloat16* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return own_kernel::scale_by_beta(m, n, beta == 0.0f ? 0.0f : 1.0f, c, ldc);
  const auto a_view = own_kernel::view_of<own_kernel::bits_of<AElement>>(ta, a, lda);
  const auto b_view = own_kernel::view_of<own_kernel::bits_of<BElement>>(tb, b, ldb);
  if (k <= own_kernel::max_depth)
    return own_kernel::gemm_on(unit, m, n, k, alpha, a_view, b_view, beta, reinterpret_cast<std::uint16_t*>(c), ldc);
  // Deeper: the fp32 sum in a buffer of its own, then rounded in (lce's host backend does not
  // call it so: it keeps deeper dW tiles in its workspace).
  round_sum_into_bf16(m, n, beta, c, ldc,
                      [&](float* sum) { own_kernel::gemm_on(unit, m, n, k, alpha, a_view, b_view, 0.0f, sum, n); });
}

#pragma GCC diagnostic pop
#undef LCE_BF16_KERNEL_TARGET

#else

inline bool amx_bf16_gemm_available() { return false; }
inline bool avx512_bf16_gemm_available() { return false; }
inline constexpr std::size_t own_bf16_gemm_scratch_bytes = 0;
inline std::size_t own_bf16_gemm_thread_scratch_bytes() { return 0; }

// Never called: no unit is available here.
inline void own_bf16_gemm(bf16_unit, transpose, transpose, std::int64_t, std::int64_t, std::int64_t, float,
                          const bfloat16*, std::int64_t, const bfloat16*, std::int64_t, float, float*, std::int64_t) {
  std::abort();
}

template <class BElement>
inline void own_split_bf16_gemm(bf16_unit, transpose, transpose, std::int64_t, std::int64_t, std::int64_t, float,
                                const float*, std::int64_t, const BElement*, std::int64_t, float, float*,
                                std::int64_t) {
  std::abort();
}

template <class AElement, class BElement>
inline void own_bf16_gemm_into_bf16(bf16_unit, transpose, transpose, std::int64_t, std::int64_t, std::int64_t, float,
                                    const AElement*, std::int64_t, const BElement*, std::int64_t, float, bfloat16*,
                                    std::int64_t) {
  std::abort();
}

#endif

// Whether lce's kernel runs on `unit` here.
inline bool own_bf16_gemm_available(bf16_unit unit) {
  return unit == bf16_unit::amx ? amx_bf16_gemm_available() : avx512_bf16_gemm_available();
}

// A provider's bf16_gemm_into_bf16 (gemm_provider.hpp): this kernel on `unit` where the
// provider runs it, else the provider's own bf16_gemm into an fp32 sum rounded in.
template <class Provider>
void bf16_gemm_into_bf16_of(const Provider& provider, std::optional<bf16_unit> unit, transpose ta, transpose tb,
                            std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
                            std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, bfloat16* c,
                            std::int64_t ldc) {
  if (unit) return own_bf16_gemm_into_bf16(*unit, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  round_sum_into_bf16(m, n, beta, c, ldc,
                      [&](float* sum) { provider.bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, sum, n); });
}

}  // namespace detail
LCE_END_NAMESPACE
