// The CUDA backend against what a user would do otherwise and against what
// the GPU can do, in one run (issue: "GPU check"):
//
//   lce forward / backward / forward_backward     time and peak extra device memory
//   materialised: cuBLAS logits [N, V] in fp32 + a softmax kernel + the two
//                 gradient GEMMs                    (what a plain framework does)
//   bare GEMMs of the same shapes                 (the floor: lce's ratio to it)
//
// then the longest sequence whose LM-head step fits a device-memory budget,
// for lce and for materialised logits, from the peaks measured at two N.
// Peaks are the high-water mark of the device's default stream-ordered pool,
// which lce's scratch and the baseline's buffers come from; inputs and
// outputs are plain cudaMalloc and counted separately.
//
//   lce_bench_cuda [--tokens 8192] [--hidden 4096] [--vocab 128256] [--repeats 5]
//                  [--budget-gib 40] [--fit-hidden 3584] [--fit-vocab 152064] [--json FILE]

#include <lce/cuda.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using bf16 = lce::bfloat16;

struct settings {
  std::int64_t tokens = 8192, hidden = 4096, vocab = 128256;
  int repeats = 5;
  double budget_gib = 40;
  std::int64_t fit_hidden = 3584, fit_vocab = 152064;
  std::string json;
};

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--tokens") s.tokens = std::stoll(value);
    else if (name == "--hidden") s.hidden = std::stoll(value);
    else if (name == "--vocab") s.vocab = std::stoll(value);
    else if (name == "--repeats") s.repeats = std::stoi(value);
    else if (name == "--budget-gib") s.budget_gib = std::stod(value);
    else if (name == "--fit-hidden") s.fit_hidden = std::stoll(value);
    else if (name == "--fit-vocab") s.fit_vocab = std::stoll(value);
    else if (name == "--json") s.json = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", name.c_str());
      std::exit(2);
    }
  }
  return s;
}

template <class E>
E* device_alloc(std::size_t count) {
  void* p = nullptr;
  LCE_CUDA_TRY(cudaMalloc(&p, count * sizeof(E)));
  return static_cast<E*>(p);
}

// The default pool's high-water mark, reset before each measured call.
struct pool_peak {
  cudaMemPool_t pool{};
  explicit pool_peak(int device) {
    LCE_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t keep = UINT64_MAX;  // never hand memory back between calls: timings without re-mapping
    LCE_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  void reset() {
    std::uint64_t zero = 0;
    LCE_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  }
  double mib() const {
    std::uint64_t high = 0;
    LCE_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    return static_cast<double>(high) / (1 << 20);
  }
};

// Best of `repeats` timed runs (after one warm-up), in milliseconds.
double time_ms(cudaStream_t stream, int repeats, const std::function<void()>& run) {
  cudaEvent_t start, stop;
  LCE_CUDA_TRY(cudaEventCreate(&start));
  LCE_CUDA_TRY(cudaEventCreate(&stop));
  run();
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));
  float best = 1e30f;
  for (int r = 0; r < repeats; ++r) {
    LCE_CUDA_TRY(cudaEventRecord(start, stream));
    run();
    LCE_CUDA_TRY(cudaEventRecord(stop, stream));
    LCE_CUDA_TRY(cudaEventSynchronize(stop));
    float ms = 0;
    LCE_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// Materialised baseline's row pass: log-softmax statistics of a whole row and
// dz = g (onehot - softmax) written as bf16 for the gradient GEMMs. Written
// plainly (two reads of the row), independent of lce's kernels.
__global__ void materialised_softmax_grad(const float* logits, std::int64_t vocab, const std::int64_t* targets,
                                          const float* grad_logprobs, float* logprobs, bf16* dz) {
  __shared__ float shared[256];
  const std::int64_t r = blockIdx.x;
  const float* row = logits + r * vocab;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, row[j]);
  shared[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + w]);
    __syncthreads();
  }
  m = shared[0];
  __syncthreads();
  float s = 0;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(row[j] - m);
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) shared[threadIdx.x] += shared[threadIdx.x + w];
    __syncthreads();
  }
  const float lse = m + logf(shared[0]);
  const float g = grad_logprobs[r];
  const std::int64_t y = targets[r];
  if (threadIdx.x == 0) logprobs[r] = row[y] - lse;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float d = -g * expf(row[j] - lse) + (j == y ? g : 0.0f);
    dz[r * vocab + j] = bf16(d);
  }
}

__global__ void fill_random_bf16(bf16* data, std::int64_t count, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t x = (static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    const float u = static_cast<float>(x >> 40) / static_cast<float>(1ull << 24);  // [0, 1)
    data[i] = bf16(scale * (2 * u - 1));
  }
}

struct problem {
  std::int64_t n, h, v;
  bf16 *hidden, *weight, *grad_hidden, *grad_weight;
  std::int64_t* targets;
  float *logprobs, *lse, *grad_logprobs;
};

problem make_problem(std::int64_t n, std::int64_t h, std::int64_t v, cudaStream_t stream) {
  problem p{n, h, v};
  p.hidden = device_alloc<bf16>(n * h);
  p.weight = device_alloc<bf16>(v * h);
  p.grad_hidden = device_alloc<bf16>(n * h);
  p.grad_weight = device_alloc<bf16>(v * h);
  p.targets = device_alloc<std::int64_t>(n);
  p.logprobs = device_alloc<float>(n);
  p.lse = device_alloc<float>(n);
  p.grad_logprobs = device_alloc<float>(n);
  fill_random_bf16<<<1024, 256, 0, stream>>>(p.hidden, n * h, 1, 1.0f);
  fill_random_bf16<<<1024, 256, 0, stream>>>(p.weight, v * h, 2, 1.0f / std::sqrt(static_cast<float>(h)));
  LCE_CUDA_TRY(cudaMemsetAsync(p.grad_weight, 0, v * h * sizeof(bf16), stream));
  std::vector<std::int64_t> y(n);
  std::vector<float> g(n, -1.0f / static_cast<float>(n));
  std::mt19937_64 rng(3);
  for (auto& t : y) t = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(v));
  LCE_CUDA_TRY(cudaMemcpy(p.targets, y.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  LCE_CUDA_TRY(cudaMemcpy(p.grad_logprobs, g.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));
  return p;
}

void free_problem(problem& p) {
  for (void* q : {static_cast<void*>(p.hidden), static_cast<void*>(p.weight), static_cast<void*>(p.grad_hidden),
                  static_cast<void*>(p.grad_weight), static_cast<void*>(p.targets), static_cast<void*>(p.logprobs),
                  static_cast<void*>(p.lse), static_cast<void*>(p.grad_logprobs)})
    cudaFree(q);
}

struct measured {
  double ms = 0, peak_mib = 0;
};

struct lce_results {
  measured forward, backward, fused;
};

using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::single, bf16, lce::budget_chunk, lce::cuda_backend>;

// The default options: a budget of 256 MiB of scratch, within which a bf16
// grad_weight's call may take the vocabulary order (4 GEMMs, no [V, H] fp32
// accumulator). token_order: chunks of the budget's size fixed, so the
// call keeps the token order (3 GEMMs and the accumulator).
lce_results run_lce(const problem& p, cudaStream_t stream, pool_peak& peak, int repeats, bool token_order = false) {
  lce::options opt;
  if (token_order) opt.chunk_tokens = op_t{lce::comm::single{}, opt, lce::cuda_backend{stream}}.chunk_tokens(p.n, p.h, p.v);
  op_t op{lce::comm::single{}, opt, lce::cuda_backend{stream}};
  const lce::matrix_view<const bf16> hidden{p.hidden, p.n, p.h}, weight{p.weight, p.v, p.h};
  const lce::vector_view<const std::int64_t> targets{p.targets, p.n};
  const lce::vector_view<float> logprobs{p.logprobs, p.n}, lse{p.lse, p.n};
  const lce::vector_view<const float> grad{p.grad_logprobs, p.n}, lse_in{p.lse, p.n};
  const lce::matrix_view<bf16> grad_hidden{p.grad_hidden, p.n, p.h}, grad_weight{p.grad_weight, p.v, p.h};
  const auto measure = [&](const std::function<void()>& call) {
    op.release_workspace();
    LCE_CUDA_TRY(cudaStreamSynchronize(stream));
    peak.reset();
    measured m;
    m.ms = time_ms(stream, repeats, call);
    m.peak_mib = peak.mib();
    return m;
  };
  lce_results r;
  r.forward = measure([&] { op.forward(hidden, weight, targets, logprobs, lse); });
  r.backward = measure([&] { op.backward(hidden, weight, targets, lse_in, grad, grad_hidden, grad_weight); });
  r.fused = measure([&] { op.forward_backward(hidden, weight, targets, grad, logprobs, grad_hidden, grad_weight); });
  return r;
}

struct gemm_floor {
  double logits_ms = 0, grad_hidden_ms = 0, grad_weight_ms = 0;
};

// The three GEMMs of the whole batch at once, bf16 in, fp32 accumulate (fp32
// logits out, bf16 gradient outputs as the operator's grads here).
struct baseline {
  cublasHandle_t handle{};
  explicit baseline(cudaStream_t stream) {
    LCE_CUBLAS_TRY(cublasCreate(&handle));
    LCE_CUBLAS_TRY(cublasSetStream(handle, stream));
  }
  ~baseline() { cublasDestroy(handle); }

  void logits(const problem& p, float* out) const {
    lce::detail::cublas::logits<bf16, float>(handle, false, {p.hidden, p.n, p.h}, {p.weight, p.v, p.h}, 1.0f,
                                             {out, p.n, p.v});
  }
  void grad_hidden(const problem& p, const bf16* dz, float* out) const {
    lce::detail::cublas::grad_hidden<bf16, float>(handle, false, {dz, p.n, p.v}, {p.weight, p.v, p.h}, 1.0f,
                                                  {out, p.n, p.h}, 0.0f);
  }
  void grad_weight(const problem& p, const bf16* dz, float* out) const {
    lce::detail::cublas::grad_weight<bf16, float, float>(handle, false, {dz, p.n, p.v}, {p.hidden, p.n, p.h}, 1.0f,
                                                         {out, p.v, p.h}, 1.0f);
  }
};

template <class E>
E* pool_alloc(std::size_t count, cudaStream_t stream) {
  void* q = nullptr;
  LCE_CUDA_TRY(cudaMallocAsync(&q, count * sizeof(E), stream));
  return static_cast<E*>(q);
}

gemm_floor run_gemms(const problem& p, cudaStream_t stream, int repeats) {
  baseline b(stream);
  float* z = device_alloc<float>(p.n * p.v);
  bf16* dz = device_alloc<bf16>(p.n * p.v);
  float* dx = device_alloc<float>(p.n * p.h);
  float* dw = device_alloc<float>(p.v * p.h);
  LCE_CUDA_TRY(cudaMemsetAsync(dz, 0, p.n * p.v * sizeof(bf16), stream));
  gemm_floor f;
  f.logits_ms = time_ms(stream, repeats, [&] { b.logits(p, z); });
  f.grad_hidden_ms = time_ms(stream, repeats, [&] { b.grad_hidden(p, dz, dx); });
  f.grad_weight_ms = time_ms(stream, repeats, [&] { b.grad_weight(p, dz, dw); });
  for (void* q : {static_cast<void*>(z), static_cast<void*>(dz), static_cast<void*>(dx), static_cast<void*>(dw)})
    cudaFree(q);
  return f;
}

// Materialised forward+backward, every intermediate from the pool: fp32
// logits, bf16 dz, fp32 dX and dW staged and converted as a framework would.
measured run_materialised(const problem& p, cudaStream_t stream, pool_peak& peak, int repeats) {
  baseline b(stream);
  const auto step = [&] {
    float* z = pool_alloc<float>(p.n * p.v, stream);
    bf16* dz = pool_alloc<bf16>(p.n * p.v, stream);
    b.logits(p, z);
    materialised_softmax_grad<<<static_cast<unsigned>(p.n), 256, 0, stream>>>(z, p.v, p.targets, p.grad_logprobs,
                                                                             p.logprobs, dz);
    LCE_CUDA_TRY(cudaFreeAsync(z, stream));
    float* dx = pool_alloc<float>(p.n * p.h, stream);
    float* dw = pool_alloc<float>(p.v * p.h, stream);
    b.grad_hidden(p, dz, dx);
    b.grad_weight(p, dz, dw);
    LCE_CUDA_TRY(cudaFreeAsync(dz, stream));
    LCE_CUDA_TRY(cudaFreeAsync(dx, stream));
    LCE_CUDA_TRY(cudaFreeAsync(dw, stream));
  };
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));
  peak.reset();
  measured m;
  m.ms = time_ms(stream, repeats, step);
  m.peak_mib = peak.mib();
  return m;
}

// Largest N with input_bytes(N) + fixed + per_token N <= budget.
std::int64_t longest(double budget_bytes, std::int64_t h, std::int64_t v, double fixed, double per_token) {
  const double weights = 2.0 * 2 * v * h;
  const double per_token_all = per_token + 2.0 * 2 * h + 20.0;
  const double left = budget_bytes - weights - fixed;
  return left <= 0 ? 0 : static_cast<std::int64_t>(left / per_token_all);
}

// Peak extra bytes of lce (the largest of its three calls) and of the materialised step at n tokens.
void measure_peaks(std::int64_t n, std::int64_t h, std::int64_t v, cudaStream_t stream, pool_peak& peak,
                   double& lce_bytes, double& materialised_bytes) {
  problem q = make_problem(n, h, v, stream);
  const lce_results r = run_lce(q, stream, peak, 1);
  lce_bytes = std::max(std::max(r.forward.peak_mib, r.backward.peak_mib), r.fused.peak_mib) * (1 << 20);
  materialised_bytes = run_materialised(q, stream, peak, 1).peak_mib * (1 << 20);
  free_problem(q);
}

struct fitted {
  std::int64_t longest_n = 0;
  double per_token = 0;
};

// Peaks measured at n1 and n2 tokens -> fixed + per-token bytes -> the longest N in the budget.
fitted fit(const double* peaks, std::int64_t n1, std::int64_t n2, double budget, std::int64_t h, std::int64_t v) {
  fitted f;
  f.per_token = std::max(0.0, (peaks[1] - peaks[0]) / static_cast<double>(n2 - n1));
  const double fixed = peaks[0] - f.per_token * static_cast<double>(n1);
  f.longest_n = longest(budget, h, v, fixed, f.per_token);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("lce_bench_cuda: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  LCE_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %.1f GiB)\n", prop.name, prop.major, prop.minor,
              static_cast<double>(prop.totalGlobalMem) / (1ull << 30));
  cudaStream_t stream;
  LCE_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  pool_peak peak(0);

  std::printf("\n== N = %lld, H = %lld, V = %lld, bf16 inputs, fp32 accumulation ==\n",
              static_cast<long long>(s.tokens), static_cast<long long>(s.hidden), static_cast<long long>(s.vocab));
  problem p = make_problem(s.tokens, s.hidden, s.vocab, stream);
  const gemm_floor floor = run_gemms(p, stream, s.repeats);
  const lce_results lce_r = run_lce(p, stream, peak, s.repeats);
  const lce_results token_r = run_lce(p, stream, peak, s.repeats, /*token_order=*/true);
  const measured mat = run_materialised(p, stream, peak, s.repeats);
  free_problem(p);

  const double fwd_floor = floor.logits_ms;
  const double bwd_floor = floor.logits_ms + floor.grad_hidden_ms + floor.grad_weight_ms;
  const double logits_mib = static_cast<double>(s.tokens) * s.vocab * 4 / (1 << 20);
  std::printf("bare cuBLAS GEMMs: logits %.2f ms, dX %.2f ms, dW %.2f ms\n", floor.logits_ms, floor.grad_hidden_ms,
              floor.grad_weight_ms);
  std::printf("%-28s %10s %12s %16s\n", "", "ms", "x GEMMs", "extra MiB");
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "lce forward", lce_r.forward.ms, lce_r.forward.ms / fwd_floor,
              lce_r.forward.peak_mib);
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "lce backward", lce_r.backward.ms, lce_r.backward.ms / bwd_floor,
              lce_r.backward.peak_mib);
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "lce forward+backward", lce_r.forward.ms + lce_r.backward.ms,
              (lce_r.forward.ms + lce_r.backward.ms) / bwd_floor,
              std::max(lce_r.forward.peak_mib, lce_r.backward.peak_mib));
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "lce forward_backward (fused)", lce_r.fused.ms, lce_r.fused.ms / bwd_floor,
              lce_r.fused.peak_mib);
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "  token order, fused", token_r.fused.ms, token_r.fused.ms / bwd_floor,
              token_r.fused.peak_mib);
  std::printf("%-28s %10.2f %12.3f %16.1f\n", "materialised fwd+bwd", mat.ms, mat.ms / bwd_floor, mat.peak_mib);
  std::printf("(x GEMMs: forward against the logits GEMM, the rest against all three; the [N, V] fp32 logits "
              "alone are %.0f MiB)\n", logits_mib);

  // Longest N in the budget, at the origin's shape: peaks at two N give fixed + per-token.
  std::printf("\n== longest sequence for the LM-head step in %.0f GiB, H = %lld, V = %lld (bf16) ==\n", s.budget_gib,
              static_cast<long long>(s.fit_hidden), static_cast<long long>(s.fit_vocab));
  const std::int64_t n1 = 2048, n2 = 8192;
  double lce_peak[2], mat_peak[2];
  for (int k = 0; k < 2; ++k)
    measure_peaks(k == 0 ? n1 : n2, s.fit_hidden, s.fit_vocab, stream, peak, lce_peak[k], mat_peak[k]);
  const double budget = s.budget_gib * (1ull << 30);
  const fitted lce_fit = fit(lce_peak, n1, n2, budget, s.fit_hidden, s.fit_vocab);
  const fitted mat_fit = fit(mat_peak, n1, n2, budget, s.fit_hidden, s.fit_vocab);
  const std::int64_t lce_n = lce_fit.longest_n, mat_n = mat_fit.longest_n;
  const double lce_per = lce_fit.per_token, mat_per = mat_fit.per_token;
  std::printf("%-16s %18s %14s\n", "", "extra B/token", "longest N");
  std::printf("%-16s %18.0f %14lld\n", "lce", lce_per, static_cast<long long>(lce_n));
  std::printf("%-16s %18.0f %14lld\n", "materialised", mat_per, static_cast<long long>(mat_n));
  std::printf("(counted: hidden, grad_hidden, weight, grad_weight in bf16, targets and per-token outputs, plus the "
              "measured extra)\n");

  if (!s.json.empty()) {
    std::ofstream out(s.json);
    out << "{\"device\": \"" << prop.name << "\", \"tokens\": " << s.tokens << ", \"hidden\": " << s.hidden
        << ", \"vocab\": " << s.vocab << ", \"gemm_ms\": {\"logits\": " << floor.logits_ms
        << ", \"grad_hidden\": " << floor.grad_hidden_ms << ", \"grad_weight\": " << floor.grad_weight_ms
        << "}, \"lce\": {\"forward_ms\": " << lce_r.forward.ms << ", \"backward_ms\": " << lce_r.backward.ms
        << ", \"fused_ms\": " << lce_r.fused.ms << ", \"forward_peak_mib\": " << lce_r.forward.peak_mib
        << ", \"backward_peak_mib\": " << lce_r.backward.peak_mib << ", \"fused_peak_mib\": " << lce_r.fused.peak_mib
        << "}, \"lce_token_order\": {\"fused_ms\": " << token_r.fused.ms << ", \"fused_peak_mib\": "
        << token_r.fused.peak_mib << "}, \"materialised\": {\"ms\": " << mat.ms << ", \"peak_mib\": " << mat.peak_mib
        << "}, \"longest\": {\"budget_gib\": " << s.budget_gib << ", \"lce\": " << lce_n
        << ", \"materialised\": " << mat_n << "}}\n";
  }
  cudaStreamDestroy(stream);
  return 0;
}
