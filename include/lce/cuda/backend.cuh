#pragma once
// lce::cuda_backend: the operator's arithmetic on an NVIDIA GPU (nvcc only;
// CMake target lce::cuda).
//
//   lce::cuda_backend{stream}                       all work on `stream`
//   lce::cuda_backend{stream, {.allow_tf32 = true}}  fp32 GEMMs on TF32 tensor cores
//   lce::cuda_backend{stream, {.workspace = p, .workspace_bytes = n}}
//                                                   scratch carved from the caller's device buffer
//   lce::cuda_backend{stream, {.allocate = a, .deallocate = d, .allocator_context = c}}
//                                                   scratch from the caller's allocator (a
//                                                   framework's caching allocator)
//
// Every view the operator gets holds device pointers. GEMMs run through
// cublasGemmEx: fp32, bf16 and fp16 inputs multiply as stored and accumulate
// in fp32 (double in double); the row passes are the kernels of
// detail/row_kernels.cuh over core/row_math.hpp. Everything is ordered on
// the stream; a call synchronises it once, before its sweep, to read the
// targets' check (their range and fingerprint), and never inside the sweep.
//
// With 2-byte inputs, dz is rounded to the storage type before the two
// gradient GEMMs (tensor cores take bf16 x bf16, not fp32 x bf16); the
// products still accumulate in fp32. A 2-byte grad_weight gets each sum
// once: a call of one chunk has cuBLAS round it straight into grad_weight;
// one of several sums it in an fp32 accumulator, added in by the last
// chunk's GEMM; and on one rank, where that holds less, the call takes all
// its tokens a vocabulary tile at a time (the engine's vocabulary order:
// one more GEMM, an [N, H] fp32 sum of dX instead of the [V, H] accumulator).

#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>
#include <lce/cuda/detail/caller_workspace.hpp>
#include <lce/cuda/detail/cublas_gemm.cuh>
#include <lce/cuda/detail/launch_shape.hpp>
#include <lce/cuda/detail/plan_traits.hpp>
#include <lce/cuda/detail/row_kernels.cuh>
#include <lce/cuda/error.cuh>
#include <lce/detail/workspace.hpp>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

LCE_BEGIN_NAMESPACE

struct cuda_backend_options {
  // fp32 inputs: let cuBLAS use TF32 tensor cores (10-bit mantissa products).
  bool allow_tf32 = false;
  // A device buffer (64-byte aligned) the operator's scratch is carved from instead of
  // stream-ordered allocations (size it with the operator's workspace_bytes).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // Or the caller's allocator, so that a framework's caching allocator (its
  // pool and its statistics) serves the scratch: allocate returns device
  // memory (64-byte aligned) usable in stream order on `stream`, or nullptr
  // when there is none; deallocate gives it back in stream order. Both, or
  // neither; not with `workspace`. `allocator_context` is passed to both.
  void* (*allocate)(std::size_t bytes, cudaStream_t stream, void* context) = nullptr;
  void (*deallocate)(void* pointer, std::size_t bytes, cudaStream_t stream, void* context) = nullptr;
  void* allocator_context = nullptr;
};

// Its plan traits (memory space, operands, block bound, dW tiles) are
// detail::cuda_plan_traits, which the host-compiled tests share.
class cuda_backend : public detail::cuda_plan_traits {
 public:

  explicit cuda_backend(cudaStream_t stream, cuda_backend_options opt = {})
      : state_(std::make_unique<state>(stream, opt)) {}

  cudaStream_t stream() const { return state_->stream; }
  const cuda_backend_options& settings() const { return state_->options; }

  // ---- memory --------------------------------------------------------------

  void* allocate(std::size_t bytes) {
    auto& s = *state_;
    expect_own_device("an allocation");
    if (s.options.workspace) return s.caller_buffer.carve(bytes);
    if (s.options.allocate) {
      void* pointer = s.options.allocate(bytes, s.stream, s.options.allocator_context);
      if (!pointer) throw std::bad_alloc();
      if (reinterpret_cast<std::uintptr_t>(pointer) % detail::workspace_alignment != 0) {
        s.options.deallocate(pointer, bytes, s.stream, s.options.allocator_context);
        detail::fail("cuda_backend_options::allocate returned ", pointer, ", not aligned to ",
                     detail::workspace_alignment, " bytes");
      }
      return pointer;
    }
    void* pointer = nullptr;
    const cudaError_t status = cudaMallocAsync(&pointer, bytes, s.stream);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it
      throw std::bad_alloc();
    }
    LCE_CUDA_TRY(status);
    return pointer;
  }

  void deallocate(void* pointer, std::size_t bytes) noexcept {
    auto& s = *state_;
    if (s.options.workspace) return s.caller_buffer.give_back(pointer);
    if (s.options.deallocate) return s.options.deallocate(pointer, bytes, s.stream, s.options.allocator_context);
    (void)cudaFreeAsync(pointer, s.stream);
  }

  template <class T>
  std::int64_t weight_block_elements(std::int64_t, std::int64_t) const {
    return 0;
  }

  // ---- GEMMs ---------------------------------------------------------------

  template <class In, class A>
  void logits(matrix_view<const In> x, matrix_view<const In> w, A alpha, matrix_view<A> out, void*) {
    detail::cublas::logits(handle(), state_->options.allow_tf32, x, w, alpha, out);
  }

  // dx = alpha dz w + beta dx; beta 1 sums the vocabulary tiles' shares (adds_grad_hidden).
  template <class In, class A>
  void grad_hidden(matrix_view<const In> dz, matrix_view<const In> w, A alpha, matrix_view<A> dx, void*,
                   A beta = A(0)) {
    detail::cublas::grad_hidden(handle(), state_->options.allow_tf32, dz, w, alpha, dx, beta);
  }

  // dw = alpha dz^T x + beta dw into a grad_weight of the compute type: beta 1 adds, beta 0
  // (overwrites_compute_weight_gradient) writes it without reading it.
  template <class In, class A>
  void grad_weight(matrix_view<const In> dz, matrix_view<const In> x, A alpha, matrix_view<A> dw, A beta = A(1)) {
    detail::cublas::grad_weight(handle(), state_->options.allow_tf32, dz, x, alpha, dw, beta);
  }

  // dw += alpha dz^T x into a 2-byte grad_weight of the inputs' own type
  // (adds_weight_gradient_tiles; no tile scratch, see cuda_plan_traits).
  template <class O, class A, class G>
    requires(!std::same_as<A, G> && std::same_as<O, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<G> dw, A*) {
    detail::cublas::grad_weight(handle(), state_->options.allow_tf32, dz, x, alpha, dw, A(1));
  }

  // dw = alpha dz^T x + beta dw on a call's [V_local, H] accumulator
  // (rounds_accumulated_weight_gradient): the first chunk overwrites it
  // (beta 0, no fill beforehand) and the last, with round_into, adds the
  // finished sums into the grad_weight of element G.
  template <class O, class A, class G>
    requires(!std::same_as<A, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<A> dw, A beta,
                   matrix_view<G> round_into) {
    detail::cublas::grad_weight(handle(), state_->options.allow_tf32, dz, x, alpha, dw, beta);
    if (round_into.data) add(matrix_view<const A>(dw), round_into);
  }

  // ---- element conversions -------------------------------------------------

  template <class From, class To>
  void copy(matrix_view<From> source, matrix_view<To> target) {
    convert<std::remove_const_t<From>, To, false>(source, target);
  }

  template <class From, class To>
  void copy(vector_view<From> source, vector_view<To> target) {
    using F = std::remove_const_t<From>;
    convert<F, To, false>(matrix_view<const F>{source.data, 1, source.size, source.size},
                          matrix_view<To>{target.data, 1, target.size, target.size});
  }

  template <class From, class To>
  void add(matrix_view<From> source, matrix_view<To> target) {
    convert<std::remove_const_t<From>, To, true>(source, target);
  }

  template <class A>
  void fill_zero(matrix_view<A> target) {
    const auto tiles = detail::cuda_launch::element_tiles(target.rows, target.cols);
    if (tiles.count == 0) return;
    detail::cuda_kernels::fill_zero_kernel<A>
        <<<launch_blocks(tiles.launch), tiles.launch.threads, 0, stream()>>>(target, tiles.per_row, tiles.count);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  // ---- row passes ----------------------------------------------------------

  template <class A>
  void soft_cap(matrix_view<A> logits, const detail::soft_cap_map<A>& cap) {
    const auto tiles = detail::cuda_launch::element_tiles(logits.rows, logits.cols);
    if (tiles.count == 0) return;
    detail::cuda_kernels::soft_cap_kernel<A>
        <<<launch_blocks(tiles.launch), tiles.launch.threads, 0, stream()>>>(logits, cap, tiles.per_row, tiles.count);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  template <class A, class B>
  void add_bias(matrix_view<A> logits, vector_view<const B> bias, A alpha) {
    const auto tiles = detail::cuda_launch::element_tiles(logits.rows, logits.cols);
    if (tiles.count == 0) return;
    detail::cuda_kernels::add_bias_kernel<A, B><<<launch_blocks(tiles.launch), tiles.launch.threads, 0, stream()>>>(
        logits, bias, alpha, tiles.per_row, tiles.count);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  template <class O, class A>
  void column_sums(matrix_view<const O> dz, A alpha, vector_view<A> out) {
    launch_per_item(dz.cols, detail::cuda_kernels::column_sums_kernel<O, A>, dz, alpha, out.data);
  }

  template <class A, class I>
  void row_statistics(const statistics_args<A, I>& args) {
    const auto launch = detail::cuda_launch::one_block_per_row(args.logits.rows);
    if (launch.blocks == 0) return;
    const auto run = [&](auto kernel) {
      kernel<<<launch_blocks(launch), launch.threads, 0, stream()>>>(args);
      LCE_CUDA_TRY(cudaGetLastError());
    };
    const bool capped = args.soft_cap.enabled();
    namespace k = detail::cuda_kernels;
    if (args.with_entropy)
      capped ? run(k::row_statistics_kernel<A, I, true, true>) : run(k::row_statistics_kernel<A, I, true, false>);
    else
      capped ? run(k::row_statistics_kernel<A, I, false, true>) : run(k::row_statistics_kernel<A, I, false, false>);
  }

  template <class A>
  void merge_partials(const detail::row_partial<A>* gathered, int ranks, std::int64_t rows, std::int64_t stride,
                      detail::row_partial<A>* merged) {
    const auto launch = detail::cuda_launch::one_thread_per_item(rows);
    if (launch.blocks == 0) return;
    detail::cuda_kernels::merge_partials_kernel<A>
        <<<launch_blocks(launch), launch.threads, 0, stream()>>>(gathered, ranks, rows, stride, merged);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  template <class A, class I>
  void finalize_rows(const finalize_args<A, I>& args, std::int64_t rows) {
    const auto launch = detail::cuda_launch::one_thread_per_item(rows);
    if (launch.blocks == 0) return;
    detail::cuda_kernels::finalize_rows_kernel<A, I><<<launch_blocks(launch), launch.threads, 0, stream()>>>(args, rows);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  template <class A, class I>
  void mean_centred_logits(const mean_centred_logit_args<A, I>& args) {
    const auto launch = detail::cuda_launch::one_block_per_row(args.logits.rows);
    if (launch.blocks == 0) return;
    detail::cuda_kernels::mean_centred_logits_kernel<A, I><<<launch_blocks(launch), launch.threads, 0, stream()>>>(args);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  template <class A, class I, class Out>
  void logit_gradients(const gradient_args<A, I, Out>& args) {
    const auto tiles = detail::cuda_launch::element_tiles(args.logits.rows, args.logits.cols);
    if (tiles.count == 0) return;
    // Without an operand block the gradient overwrites the logits in place.
    Out* const out = args.gradient_operand ? args.gradient_operand : reinterpret_cast<Out*>(args.logits.data);
    const std::int64_t out_ld = args.gradient_operand ? args.gradient_operand_ld : args.logits.ld;
    if (!args.gradient_operand && !std::is_same_v<Out, A>)
      detail::fail("cuda_backend::logit_gradients: a ", sizeof(Out), "-byte operand type needs its own dz block");
    const auto run = [&](auto kernel) {
      kernel<<<launch_blocks(tiles.launch), tiles.launch.threads, 0, stream()>>>(args, out, out_ld, tiles.per_row,
                                                                                   tiles.count);
      LCE_CUDA_TRY(cudaGetLastError());
    };
    namespace k = detail::cuda_kernels;
    const bool capped = args.soft_cap.enabled();
    detail::expects(!args.exp_ratios, "cuda_backend::logit_gradients: exp_ratios is for a backend that keeps_exp_ratios");
    if (args.exp_row_max) {
      detail::expects(!capped && !args.grad_entropy,
                      "cuda_backend::logit_gradients: exp_row_max goes with neither a soft-cap nor grad_entropy");
      run(k::logit_gradient_kernel<A, I, Out, false, false, true>);
    } else if (args.grad_entropy) {
      capped ? run(k::logit_gradient_kernel<A, I, Out, true, true, false>)
             : run(k::logit_gradient_kernel<A, I, Out, true, false, false>);
    } else {
      capped ? run(k::logit_gradient_kernel<A, I, Out, false, true, false>)
             : run(k::logit_gradient_kernel<A, I, Out, false, false, false>);
    }
    if (args.set_grads) {
      detail::expects(!args.exp_row_max, "cuda_backend::logit_gradients: a target set goes without exp_row_max");
      const auto items = detail::cuda_launch::one_thread_per_item(args.logits.rows * args.set_size);
      if (items.blocks == 0) return;
      const auto fix = [&](auto kernel) {
        kernel<<<launch_blocks(items), items.threads, 0, stream()>>>(args, out, out_ld, args.logits.rows);
        LCE_CUDA_TRY(cudaGetLastError());
      };
      if (args.grad_entropy)
        capped ? fix(k::target_set_gradient_kernel<A, I, Out, true, true>)
               : fix(k::target_set_gradient_kernel<A, I, Out, true, false>);
      else
        capped ? fix(k::target_set_gradient_kernel<A, I, Out, false, true>)
               : fix(k::target_set_gradient_kernel<A, I, Out, false, false>);
    }
  }

  // ---- target sets ------------------------------------------------------------

  template <class A, class I>
  void target_set_rows(const target_set_args<A, I>& args, std::int64_t rows) {
    launch_per_item(rows, detail::cuda_kernels::target_set_rows_kernel<A, I>, args, rows);
  }
  template <class A, class I>
  void target_set_logits(const target_set_args<A, I>& args, std::int64_t rows) {
    launch_per_item(rows * args.set_size, detail::cuda_kernels::target_set_logits_kernel<A, I>, args, rows);
  }
  template <class A, class I>
  void target_set_logprobs(const target_set_args<A, I>& args, std::int64_t rows) {
    launch_per_item(rows * args.set_size, detail::cuda_kernels::target_set_logprobs_kernel<A, I>, args, rows);
  }

  // ---- targets ---------------------------------------------------------------

  // Fingerprint and extremes of the target ids, read back to the host: the
  // one synchronisation of a call, before its sweep.
  template <class I>
  target_scan scan_targets(const vector_view<const I>& targets, std::int64_t ignore_index) {
    auto& s = *state_;
    expect_own_device("a call");
    detail::cuda_kernels::target_extremes found;
    if (targets.size > 0) {
      detail::cuda_kernels::scan_targets_kernel<I>
          <<<1, detail::cuda_launch::block_threads, 0, s.stream>>>(targets, ignore_index, s.scan_result);
      LCE_CUDA_TRY(cudaGetLastError());
      LCE_CUDA_TRY(cudaMemcpyAsync(s.scan_host, s.scan_result, sizeof found, cudaMemcpyDeviceToHost, s.stream));
      LCE_CUDA_TRY(cudaStreamSynchronize(s.stream));
      found = *s.scan_host;
    }
    target_scan scan;
    scan.hash = static_cast<std::int64_t>(found.hash ^ static_cast<std::uint64_t>(targets.size));
    if (found.lowest_at >= 0) {
      scan.lowest = found.lowest;
      scan.lowest_at = found.lowest_at;
      scan.highest = found.highest;
      scan.highest_at = found.highest_at;
    }
    return scan;
  }

 private:
  // The handle and the scan buffers belong to the device current at
  // construction; kernels go to whichever is current. Another device would
  // fail deep inside cuBLAS, or later, so it is named here, before any launch.
  void expect_own_device(const char* what) const {
    int current = -1;
    LCE_CUDA_TRY(cudaGetDevice(&current));
    if (current != state_->device)
      detail::fail("cuda_backend: ", what, " with CUDA device ", current, " current, but the backend was made on device ",
                   state_->device, "; make it current (cudaSetDevice) or make a backend per device");
  }

  template <class Kernel, class... Args>
  void launch_per_item(std::int64_t items, Kernel kernel, const Args&... args) {
    const auto launch = detail::cuda_launch::one_thread_per_item(items);
    if (launch.blocks == 0) return;
    kernel<<<launch_blocks(launch), launch.threads, 0, stream()>>>(args...);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  // Owned by one backend object (moved with it, never shared): the cuBLAS
  // handle bound to the stream, and the scan's small buffers.
  struct state {
    cudaStream_t stream;
    cuda_backend_options options;
    int device = -1;  // current at construction: the handle, the scan buffers and the stream's kernels live there
    cublasHandle_t handle = nullptr;
    detail::cuda_kernels::target_extremes* scan_result = nullptr;  // device
    detail::cuda_kernels::target_extremes* scan_host = nullptr;    // pinned
    detail::caller_workspace caller_buffer;  // over options.workspace, when given

    state(cudaStream_t s, cuda_backend_options opt)
        : stream(s), options(opt), caller_buffer(opt.workspace, opt.workspace_bytes) {
      // Before any CUDA call: a bad option set raises on any machine.
      detail::expects(!options.allocate == !options.deallocate,
                      "cuda_backend_options: allocate and deallocate go together (allocate ",
                      options.allocate ? "set" : "null", ", deallocate ", options.deallocate ? "set" : "null", ")");
      detail::expects(!(options.allocate && options.workspace),
                      "cuda_backend_options: workspace and allocate are two sources of the scratch; give one");
      detail::expects(reinterpret_cast<std::uintptr_t>(options.workspace) % detail::workspace_alignment == 0,
                      "cuda_backend_options::workspace ", options.workspace, " is not aligned to ",
                      detail::workspace_alignment, " bytes");
      try {
        LCE_CUDA_TRY(cudaGetDevice(&device));
        LCE_CUBLAS_TRY(cublasCreate(&handle));
        LCE_CUBLAS_TRY(cublasSetStream(handle, stream));
        // No split-K reductions in reduced precision: fp32 accumulation, whole.
        LCE_CUBLAS_TRY(cublasSetMathMode(
            handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
        LCE_CUDA_TRY(cudaMalloc(&scan_result, sizeof *scan_result));
        LCE_CUDA_TRY(cudaMallocHost(&scan_host, sizeof *scan_host));
      } catch (...) {
        release();
        throw;
      }
    }
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() { release(); }

    void release() noexcept {
      if (handle) (void)cublasDestroy(handle);
      if (scan_result) (void)cudaFree(scan_result);
      if (scan_host) (void)cudaFreeHost(scan_host);
      handle = nullptr;
      scan_result = nullptr;
      scan_host = nullptr;
    }
  };

  cublasHandle_t handle() const { return state_->handle; }

  static unsigned launch_blocks(const detail::cuda_launch::shape& launch) {
    return static_cast<unsigned>(launch.blocks);
  }

  template <class From, class To, bool Accumulate>
  void convert(matrix_view<const From> source, matrix_view<To> target) {
    const auto tiles = detail::cuda_launch::element_tiles(source.rows, source.cols);
    if (tiles.count == 0) return;
    detail::cuda_kernels::convert_kernel<From, To, Accumulate>
        <<<launch_blocks(tiles.launch), tiles.launch.threads, 0, stream()>>>(source, target, tiles.per_row,
                                                                             tiles.count);
    LCE_CUDA_TRY(cudaGetLastError());
  }

  std::unique_ptr<state> state_;
};

static_assert(backend<cuda_backend>);
static_assert(adds_grad_hidden<cuda_backend, bfloat16, bfloat16, float>);
static_assert(adds_weight_gradient_tiles<cuda_backend, bfloat16, float, bfloat16>);
static_assert(rounds_accumulated_weight_gradient<cuda_backend, float16, float, float16>);

LCE_END_NAMESPACE
