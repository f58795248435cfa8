// The README's CUDA quickstart (the region between the two markers is the
// README's snippet, checked by tests/readme_quickstart.cmake): a bf16 LM head
// on one GPU through NCCL (a communicator of one rank here; the same code
// runs tensor parallel with one rank per GPU), device views, one stream.
//
// Around it, the program makes the inputs on the device and checks the
// GPU's log-probs and mean loss against a double-precision reference on the
// host. Without a GPU it says so and exits 77 (ctest: skipped).
#include <lce/comm/nccl.cuh>
#include <lce/cuda.cuh>

#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

// The stream and the NCCL communicator, released after everything declared
// later in main (the operator's scratch is freed on the stream).
struct gpu_session {
  cudaStream_t stream = nullptr;
  ncclComm_t nccl_comm = nullptr;
  gpu_session() {
    LCE_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int device = 0;
    LCE_NCCL_TRY(ncclCommInitAll(&nccl_comm, 1, &device));
  }
  gpu_session(const gpu_session&) = delete;
  gpu_session& operator=(const gpu_session&) = delete;
  ~gpu_session() {
    (void)cudaStreamSynchronize(stream);
    (void)ncclCommDestroy(nccl_comm);
    (void)cudaStreamDestroy(stream);
  }
};

template <class E>
E* device_copy(const std::vector<E>& host, cudaStream_t stream) {
  void* p = nullptr;
  LCE_CUDA_TRY(cudaMallocAsync(&p, host.size() * sizeof(E), stream));
  LCE_CUDA_TRY(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice, stream));
  return static_cast<E*>(p);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cuda_quickstart: no CUDA device here: skipped\n");
    return 77;
  }
  const std::int64_t n_tokens = 300, hidden = 128, vocab = 5000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<std::int64_t> token(0, vocab - 1);
  std::vector<lce::bfloat16> x(n_tokens * hidden), w(vocab * hidden);
  std::vector<std::int64_t> y(n_tokens);
  for (auto& e : x) e = lce::bfloat16(normal(rng));
  for (auto& e : w) e = lce::bfloat16(0.05f * normal(rng));
  for (auto& e : y) e = token(rng);
  y[3] = -100;  // ignore_index: log-prob 0, no gradient

  const gpu_session session;
  cudaStream_t stream = session.stream;
  ncclComm_t nccl_comm = session.nccl_comm;
  const lce::bfloat16* hidden_d = device_copy(x, stream);
  const lce::bfloat16* weight_d = device_copy(w, stream);
  const std::int64_t* targets_d = device_copy(y, stream);
  float* grad_logprobs_d = device_copy(std::vector<float>(n_tokens, -1.0f / n_tokens), stream);  // d(mean NLL)
  float* logprobs_d = device_copy(std::vector<float>(n_tokens), stream);
  lce::bfloat16* grad_hidden_d = device_copy(std::vector<lce::bfloat16>(n_tokens * hidden), stream);
  lce::bfloat16* grad_weight_d = device_copy(std::vector<lce::bfloat16>(vocab * hidden), stream);  // accumulated into

  // [cuda-quickstart]
  using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::nccl, lce::bfloat16, lce::budget_chunk, lce::cuda_backend>;
  lce::options opts;
  opts.ignore_index = -100;
  op_t op{lce::comm::nccl{nccl_comm, stream}, opts, lce::cuda_backend{stream}};

  // Views over device memory: lce::matrix_view / vector_view (or cuda::std::mdspan).
  const lce::matrix_view<const lce::bfloat16> hidden_v{hidden_d, n_tokens, hidden};    // [N, H]
  const lce::matrix_view<const lce::bfloat16> weight_v{weight_d, vocab, hidden};       // [V_local, H]
  const lce::vector_view<const std::int64_t> targets_v{targets_d, n_tokens};
  const lce::vector_view<const float> grad_logprobs_v{grad_logprobs_d, n_tokens};      // dL/dlogprob
  const lce::vector_view<float> logprobs_v{logprobs_d, n_tokens};
  const lce::matrix_view<lce::bfloat16> grad_hidden_v{grad_hidden_d, n_tokens, hidden};  // overwritten
  const lce::matrix_view<lce::bfloat16> grad_weight_v{grad_weight_d, vocab, hidden};     // accumulated into
  op.forward_backward(hidden_v, weight_v, targets_v, grad_logprobs_v, logprobs_v, grad_hidden_v, grad_weight_v);
  // Everything above is queued on `stream`; results are there once it is done.
  // [cuda-quickstart]

  std::vector<float> logprobs(n_tokens);
  LCE_CUDA_TRY(cudaMemcpyAsync(logprobs.data(), logprobs_d, n_tokens * sizeof(float), cudaMemcpyDeviceToHost, stream));
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));

  // The same values in double on the host: log-probs and the mean loss agree.
  std::vector<double> want(n_tokens, 0.0);
  std::vector<double> logits(vocab);
  for (std::int64_t i = 0; i < n_tokens; ++i) {
    if (y[i] == opts.ignore_index) continue;
    double top = -INFINITY, sum = 0;
    for (std::int64_t j = 0; j < vocab; ++j) {
      double z = 0;
      for (std::int64_t k = 0; k < hidden; ++k) z += double(float(x[i * hidden + k])) * double(float(w[j * hidden + k]));
      logits[j] = z;
      top = std::fmax(top, z);
    }
    for (const double z : logits) sum += std::exp(z - top);
    want[i] = logits[y[i]] - top - std::log(sum);
  }
  double worst = 0, loss = 0, loss_reference = 0;
  for (std::int64_t i = 0; i < n_tokens; ++i) {
    worst = std::fmax(worst, std::fabs(logprobs[i] - want[i]) / (1.0 + std::fabs(want[i])));
    loss -= logprobs[i] / n_tokens;
    loss_reference -= want[i] / n_tokens;
  }
  std::printf("cuda_quickstart: mean loss %.6f (double reference %.6f), worst log-prob difference %.2e\n", loss,
              loss_reference, worst);

  for (const void* p : {static_cast<const void*>(hidden_d), static_cast<const void*>(weight_d),
                        static_cast<const void*>(targets_d), static_cast<const void*>(grad_logprobs_d),
                        static_cast<const void*>(logprobs_d), static_cast<const void*>(grad_hidden_d),
                        static_cast<const void*>(grad_weight_d)})
    LCE_CUDA_TRY(cudaFreeAsync(const_cast<void*>(p), stream));
  if (!(worst < 1e-4)) {
    std::printf("cuda_quickstart: FAILED: the GPU's log-probs differ from the reference\n");
    return 1;
  }
  return 0;
}
