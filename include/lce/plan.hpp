#pragma once
// Memory planner for the LM-head step: how many bytes one tensor-parallel rank
// holds for the last layer's forward + backward at a given sequence length,
// and the longest sequence that fits a budget, for three ways of doing it:
//
//   plan_scheme::materialised  the [S, V/P] logits in fp32 (plus their 2-byte
//                              copy for a 2-byte dtype), as a plain linear +
//                              (vocabulary-parallel) cross-entropy keeps them
//   plan_scheme::origin        the chunked scheme lce grew from (NeMo RL): the
//                              full [S, H] hidden gathered on every rank and an
//                              fp32 [S, H] gradient, logits one chunk at a time
//   plan_scheme::lce           this library: its own workspace_bytes() (the
//                              allocation the operator makes), nothing [S, H]
//                              beyond the rank's own rows
//
//   lce::plan_request r{.hidden = 4096, .vocab = 128256, .tensor_parallel = 8,
//                       .sequence_parallel = true, .element_bytes = 2};
//   lce::step_memory m = lce::plan_step(r, lce::plan_scheme::lce, 131072);
//   std::int64_t longest = lce::longest_sequence(r, lce::plan_scheme::materialised);
//
// What is counted, per rank (the largest vocabulary shard, V_r = ceil(V / P);
// S tokens in the sequence; b = element_bytes; rows = S / P under sequence
// parallelism with P > 1, else S):
//   hidden       the rank's hidden rows            rows x H x b
//   targets      all S targets                     S x 8 (int64)
//   weight       the weight shard                  V_r x H x b
//   grad_hidden  dL/dhidden for the rank's rows    rows x H x b
//   grad_weight  dL/dweight of the shard           V_r x H x b
//   per_token    fp32 vectors of S: log-probs, lse, dL/dlogp (3 S x 4); the
//                materialised and origin schemes also keep 3 row statistics
//                (max, sum of exp, target logit) and, with P > 1, every rank's
//                copy of them (3 P S x 4) for the vocabulary-parallel merge
//   logits       materialised: S x V_r x 4 (+ S x V_r x b when b = 2: the
//                2-byte GEMM output beside its fp32 copy); origin: per chunk of
//                C_o tokens the fp32 logits, their fp32 softmax / gradient and
//                an int64 one-hot, C_o x V_r x 16; lce: 0 (in its workspace)
//   collectives  materialised, sequence parallel: the all-gathered [S, H]
//                hidden and the [S, H] dL/dhidden before its reduce-scatter
//                (2 S x H x b); origin: the gathered [S, H] x b under sequence
//                parallelism, and always its fp32 [S, H] gradient (S x H x 4);
//                lce: 0 (its per-chunk gather / reduce-scatter buffers are in
//                its workspace)
//   workspace    lce: op.workspace_bytes(S, H, V_r) of an operator with the
//                same rank count, sequence_parallel, element type and
//                workspace_limit_bytes (the logit block of one chunk, row
//                statistics, per-chunk collective buffers, and for a 2-byte
//                dtype the fp32 [V_r, H] accumulator of grad_weight, or
//                the dW tiles of a call of one chunk on one rank, or, for
//                one rank where it holds less, the vocabulary order's
//                [S, H] fp32 sum of dX and one vocabulary tile of logits,
//                for long calls of a slice of the tokens, with a [tile, H]
//                fp32 dW accumulator)
// Not counted: the rest of the model (give it as budget_bytes' complement),
// the framework's allocator slack, the CUDA context and the collectives
// library's own buffers, and activations saved by other layers. The lce
// figures use lce's host (CPU) backend's workspace plan. The CUDA backend's
// holds the same budget and weighs the same choices (chunks, accumulator,
// vocabulary order), filled differently: dz in its own 2-byte block instead
// of the host's weight-widening slots and dW tiles, and vocabulary-order
// blocks bounded by the budget alone (the host's by 16 MiB, and to a 32nd
// of the shard down to 1,024 rows, min_efficient_vocabulary_tile), and chunks
// too (the host's stop at 512 rows, enough_chunk_rows in core/backend.hpp,
// and its eighth of a longer call down to 192 rows, min_efficient_chunk_rows).

#include <lce/chunked_hidden_to_logprobs.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/host/host.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>

LCE_BEGIN_NAMESPACE

namespace detail {

// Saturating arithmetic: a plan for absurd sizes says "SIZE_MAX", never wraps.
constexpr std::size_t plan_add(std::size_t a, std::size_t b) {
  std::size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? SIZE_MAX : r;
}
constexpr std::size_t plan_mul(std::initializer_list<std::size_t> factors) {
  std::size_t r = 1;
  for (std::size_t f : factors)
    if (__builtin_mul_overflow(r, f, &r)) return SIZE_MAX;
  return r;
}
constexpr std::size_t plan_size(std::int64_t v) { return v < 0 ? 0 : static_cast<std::size_t>(v); }

}  // namespace detail

enum class plan_scheme { materialised, origin, lce };

inline constexpr std::string_view plan_scheme_name(plan_scheme scheme) {
  switch (scheme) {
    case plan_scheme::materialised: return "materialised logits";
    case plan_scheme::origin: return "origin's chunked scheme";
    case plan_scheme::lce: return "lce";
  }
  return "?";
}

struct plan_request {
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;
  int tensor_parallel = 1;               // P: ranks sharing the vocabulary
  bool sequence_parallel = false;        // each rank holds S / P hidden rows (no effect at P = 1)
  std::size_t element_bytes = 2;         // hidden, weight and gradients: 4 (fp32) or 2 (bf16 / fp16)
  std::size_t budget_bytes = std::size_t{80} << 30;                        // for longest_sequence
  std::size_t workspace_limit_bytes = options{}.workspace_limit_bytes;    // lce's chunk budget
  std::int64_t origin_chunk_tokens = 1024;                                // C_o, the origin's chunk
};

// Bytes per rank, by what holds them (see the list at the top of this file).
struct step_memory {
  std::int64_t tokens = 0;
  std::size_t hidden = 0, targets = 0, weight = 0, grad_hidden = 0, grad_weight = 0, per_token = 0;
  std::size_t logits = 0, collectives = 0, workspace = 0;
  std::int64_t chunk = 0;  // lce: rows of its logit block; origin: C_o; materialised: S

  std::size_t total() const {
    std::size_t sum = 0;
    for (std::size_t part : {hidden, targets, weight, grad_hidden, grad_weight, per_token, logits, collectives, workspace})
      sum = detail::plan_add(sum, part);
    return sum;
  }
};

// The models the planner knows by name (lce_plan --model).
struct model_preset {
  std::string_view name;
  std::int64_t hidden, vocab;
};
inline constexpr model_preset model_presets[] = {
    {"llama-3-8b", 4096, 128256},
    {"qwen2.5-7b", 3584, 152064},
    {"gemma-2-2b", 2304, 256000},
};

namespace detail {

// A communicator that only knows its size: the planner asks an operator of P
// ranks for its workspace, which never communicates.
struct planning_comm {
  using memory_space = void;
  int ranks = 1;
  int rank() const { return 0; }
  int size() const { return ranks; }
  [[noreturn]] static void never() { throw error("lce: plan: the planning communicator cannot communicate"); }
  void all_gather_bytes(const void*, void*, std::size_t) const { never(); }
  template <class A>
  void all_reduce_sum(A*, std::int64_t) const { never(); }
  template <class A>
  void reduce_scatter_sum(const A*, A*, std::int64_t) const { never(); }
  bool all_agree(bool) const { never(); }
  void all_gather_host(const std::int64_t*, std::int64_t*, std::int64_t) const { never(); }
};
static_assert(communicator<planning_comm>);

inline void check_plan_request(const plan_request& r) {
  expects(r.hidden > 0 && r.vocab > 0, "plan: hidden ", r.hidden, " and vocab ", r.vocab, " must be positive");
  expects(r.tensor_parallel >= 1 && r.tensor_parallel <= r.vocab, "plan: tensor_parallel ", r.tensor_parallel,
          " must be in [1, vocab]");
  expects(r.element_bytes == 2 || r.element_bytes == 4, "plan: element_bytes ", r.element_bytes,
          " must be 4 (fp32) or 2 (bf16 / fp16)");
  expects(r.origin_chunk_tokens >= 1, "plan: origin_chunk_tokens ", r.origin_chunk_tokens, " must be >= 1");
}

inline bool plan_sequence_parallel(const plan_request& r) { return r.sequence_parallel && r.tensor_parallel > 1; }
inline std::int64_t plan_vocab_local(const plan_request& r) {
  return r.vocab / r.tensor_parallel + (r.vocab % r.tensor_parallel != 0);  // ceil, no overflow near INT64_MAX
}

// The operator the plan stands for: P ranks, one host thread (the plan
// depends on the shapes and options only, never on threads; but for a 2-byte
// dtype, a call of one chunk on one rank holds one dW tile of about 4 MiB
// per host thread, and the plan counts one).
template <class T>
std::size_t lce_workspace_bytes(const plan_request& r, std::int64_t tokens, std::int64_t* chunk) {
  options opt;
  opt.sequence_parallel = plan_sequence_parallel(r);
  opt.workspace_limit_bytes = r.workspace_limit_bytes;
  ChunkedHiddenToLogprobs<planning_comm, T, budget_chunk, host> op{planning_comm{r.tensor_parallel}, opt, host{1}};
  const std::int64_t v_local = plan_vocab_local(r);
  if (chunk) *chunk = std::min(op.chunk_tokens(tokens, r.hidden, v_local), std::max<std::int64_t>(tokens, 1));
  return op.workspace_bytes(tokens, r.hidden, v_local);
}

}  // namespace detail

// The memory of one rank for forward + backward of the LM head over a
// sequence of `tokens` tokens. Under sequence parallelism (P > 1) `tokens`
// must be a multiple of P. Raises lce::error on a bad request.
inline step_memory plan_step(const plan_request& r, plan_scheme scheme, std::int64_t tokens) {
  using detail::plan_mul;
  using detail::plan_size;
  detail::check_plan_request(r);
  detail::expects(tokens >= 0, "plan: tokens ", tokens, " must be >= 0");
  const bool sp = detail::plan_sequence_parallel(r);
  const int p = r.tensor_parallel;
  detail::expects(!sp || tokens % p == 0, "plan: under sequence parallelism tokens (", tokens,
          ") must be a multiple of tensor_parallel (", p, ")");
  const std::size_t s = plan_size(tokens), h = plan_size(r.hidden), b = r.element_bytes;
  const std::size_t v_local = plan_size(detail::plan_vocab_local(r));
  const std::size_t rows = sp ? s / static_cast<std::size_t>(p) : s;

  step_memory m;
  m.tokens = tokens;
  m.hidden = plan_mul({rows, h, b});
  m.targets = plan_mul({s, 8});
  m.weight = plan_mul({v_local, h, b});
  m.grad_hidden = m.hidden;
  m.grad_weight = m.weight;
  const std::size_t row_statistics = plan_mul({s, 4, 3 + (p > 1 ? 3 * static_cast<std::size_t>(p) : 0)});
  m.per_token = plan_mul({s, 3, 4});
  switch (scheme) {
    case plan_scheme::materialised:
      m.chunk = tokens;
      m.per_token = detail::plan_add(m.per_token, row_statistics);
      m.logits = plan_mul({s, v_local, 4 + (b == 2 ? b : 0)});
      m.collectives = sp ? plan_mul({2, s, h, b}) : 0;
      break;
    case plan_scheme::origin: {
      const std::size_t chunk = std::min(s, plan_size(r.origin_chunk_tokens));
      m.chunk = static_cast<std::int64_t>(chunk);
      m.per_token = detail::plan_add(m.per_token, row_statistics);
      m.logits = plan_mul({chunk, v_local, 16});
      m.collectives = detail::plan_add(sp ? plan_mul({s, h, b}) : 0, plan_mul({s, h, 4}));
      break;
    }
    case plan_scheme::lce:
      m.workspace = b == 4 ? detail::lce_workspace_bytes<float>(r, tokens, &m.chunk)
                           : detail::lce_workspace_bytes<bfloat16>(r, tokens, &m.chunk);
      break;
  }
  return m;
}

// The longest sequence (tokens; a multiple of P under sequence parallelism)
// whose plan_step(...).total() fits r.budget_bytes: 0 if none does; capped at
// 2^31 (the search stops there: say "at least"). lce's chunks are evened per N
// (core/chunking.hpp), so its workspace saw-tooths by a few rows of logits as N
// grows and fits() may flip near the edge: the bisection returns a length that
// fits, within those rows' bytes of the longest (Llama-3-8B at 100K tokens under
// the 256 MiB default: about 3 rows of fp32 logits, 1.4 MB).
inline constexpr std::int64_t plan_max_tokens = std::int64_t{1} << 31;

inline std::int64_t longest_sequence(const plan_request& r, plan_scheme scheme) {
  detail::check_plan_request(r);
  const std::int64_t step = detail::plan_sequence_parallel(r) ? r.tensor_parallel : 1;
  const auto fits = [&](std::int64_t units) { return plan_step(r, scheme, units * step).total() <= r.budget_bytes; };
  std::int64_t lo = 0, hi = plan_max_tokens / step;  // fits(lo) or lo == 0
  if (!fits(0)) return 0;
  if (fits(hi)) return hi * step;
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * step;
}

LCE_END_NAMESPACE
