// lce::comm::nccl on real devices: every collective of the communicator
// concept, one rank per visible GPU (ncclCommInitAll, one host thread each),
// checked against values computed on the host. Without a GPU it says so and
// reports "skipped" to ctest (exit code 77).
#include <lce/comm/nccl.cuh>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int skipped = 77;

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

template <class A>
std::vector<A> to_host(const A* device, std::size_t count) {
  std::vector<A> host(count);
  LCE_CUDA_TRY(cudaMemcpy(host.data(), device, count * sizeof(A), cudaMemcpyDeviceToHost));
  return host;
}

template <class A>
A* to_device(const std::vector<A>& host) {
  A* device = nullptr;
  LCE_CUDA_TRY(cudaMalloc(&device, host.size() * sizeof(A)));
  LCE_CUDA_TRY(cudaMemcpy(device, host.data(), host.size() * sizeof(A), cudaMemcpyHostToDevice));
  return device;
}

// What rank r contributes: values that sum exactly in float.
template <class A>
A value(int rank, std::int64_t i) {
  return static_cast<A>(rank * 1000 + i % 97);
}

template <class A>
void check_sums(const lce::comm::nccl& comm, cudaStream_t stream) {
  const int ranks = comm.size(), rank = comm.rank();
  const std::int64_t count = 1000;
  std::vector<A> mine(static_cast<std::size_t>(count * ranks));
  for (std::int64_t i = 0; i < count * ranks; ++i) mine[static_cast<std::size_t>(i)] = value<A>(rank, i);

  A* data = to_device(mine);
  comm.all_reduce_sum(data, count * ranks);
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));
  const auto summed = to_host(data, mine.size());
  for (std::int64_t i = 0; i < count * ranks; ++i) {
    A want = 0;
    for (int r = 0; r < ranks; ++r) want += value<A>(r, i);
    require(summed[static_cast<std::size_t>(i)] == want, "all_reduce_sum at " + std::to_string(i));
  }

  A* send = to_device(mine);
  A* receive = nullptr;
  LCE_CUDA_TRY(cudaMalloc(&receive, static_cast<std::size_t>(count) * sizeof(A)));
  comm.reduce_scatter_sum(send, receive, count);
  LCE_CUDA_TRY(cudaStreamSynchronize(stream));
  const auto scattered = to_host(receive, static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    A want = 0;
    for (int r = 0; r < ranks; ++r) want += value<A>(r, rank * count + i);
    require(scattered[static_cast<std::size_t>(i)] == want, "reduce_scatter_sum at " + std::to_string(i));
  }
  LCE_CUDA_TRY(cudaFree(data));
  LCE_CUDA_TRY(cudaFree(send));
  LCE_CUDA_TRY(cudaFree(receive));
}

void run_rank(ncclComm_t handle, int device, std::string& failure) {
  try {
    LCE_CUDA_TRY(cudaSetDevice(device));
    cudaStream_t stream = nullptr;
    LCE_CUDA_TRY(cudaStreamCreate(&stream));
    const lce::comm::nccl comm{handle, stream};
    const int ranks = comm.size(), rank = comm.rank();

    // all_gather_bytes on device memory, in rank order.
    const std::size_t bytes = 24;
    std::vector<unsigned char> mine(bytes);
    for (std::size_t i = 0; i < bytes; ++i) mine[i] = static_cast<unsigned char>(rank * 31 + i);
    unsigned char* send = to_device(mine);
    unsigned char* receive = nullptr;
    LCE_CUDA_TRY(cudaMalloc(&receive, bytes * static_cast<std::size_t>(ranks)));
    comm.all_gather_bytes(send, receive, bytes);
    LCE_CUDA_TRY(cudaStreamSynchronize(stream));
    const auto gathered = to_host(receive, bytes * static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < bytes; ++i)
        require(gathered[static_cast<std::size_t>(r) * bytes + i] == static_cast<unsigned char>(r * 31 + i),
                "all_gather_bytes");
    LCE_CUDA_TRY(cudaFree(send));
    LCE_CUDA_TRY(cudaFree(receive));

    check_sums<float>(comm, stream);
    check_sums<double>(comm, stream);

    // Control collectives on host values.
    const std::int64_t record[3] = {rank, 10 * rank + 1, -rank};
    std::vector<std::int64_t> records(static_cast<std::size_t>(3 * ranks));
    comm.all_gather_host(record, records.data(), 3);
    for (int r = 0; r < ranks; ++r)
      require(records[3 * r] == r && records[3 * r + 1] == 10 * r + 1 && records[3 * r + 2] == -r, "all_gather_host");
    require(comm.all_agree(true), "all_agree(true) on every rank");
    require(!comm.all_agree(rank != ranks - 1), "all_agree with the last rank disagreeing");

    LCE_CUDA_TRY(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    failure = "rank on device " + std::to_string(device) + ": " + e.what();
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("lce nccl communicator test: no CUDA device here, skipped (it runs where GPUs exist)\n");
    return skipped;
  }
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(devices));
  std::vector<int> ids(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) ids[static_cast<std::size_t>(d)] = d;
  LCE_NCCL_TRY(ncclCommInitAll(comms.data(), devices, ids.data()));

  std::vector<std::string> failures(static_cast<std::size_t>(devices));
  std::vector<std::thread> threads;
  for (int d = 0; d < devices; ++d)
    threads.emplace_back(run_rank, comms[static_cast<std::size_t>(d)], d, std::ref(failures[static_cast<std::size_t>(d)]));
  for (auto& thread : threads) thread.join();
  for (auto comm : comms) ncclCommDestroy(comm);

  int failed = 0;
  for (const auto& failure : failures)
    if (!failure.empty()) std::printf("FAILED: %s\n", failure.c_str()), ++failed;
  std::printf("lce nccl communicator test on %d GPU rank(s): %s\n", devices, failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
