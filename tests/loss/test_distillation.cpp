// Distillation from a teacher's top-K (loss/distillation.hpp) through the
// operator's target sets: the loss against KL(teacher || student) materialised
// in double from the full logits, dX against finite differences of the whole
// path hidden -> loss, and the tails' properties.
#include "loss_support.hpp"

#include <lce/lce.hpp>

#include <algorithm>
#include <numeric>

using namespace lce_loss_test;

namespace {

struct teacher {
  std::vector<std::int64_t> ids;  // [N, K]: each token's K most likely ids (some tokens' last ids ignored)
  std::vector<double> logprobs;   // [N, K]
  std::vector<double> full;       // [N, V]: the teacher's whole distribution (log)
};

teacher make_teacher(std::int64_t n, std::int64_t v, std::int64_t k, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g(0.0, 1.5);
  teacher t;
  t.full.resize(static_cast<std::size_t>(n * v));
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<double> z(static_cast<std::size_t>(v));
    for (auto& e : z) e = g(rng);
    const double m = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (double e : z) s += std::exp(e - m);
    for (std::int64_t j = 0; j < v; ++j) t.full[i * v + j] = z[j] - m - std::log(s);
    std::vector<std::int64_t> order(static_cast<std::size_t>(v));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](auto a, auto b) { return z[a] > z[b]; });
    for (std::int64_t e = 0; e < k; ++e) {
      const bool dropped = (i % 4 == 3) && e >= k - 2;  // a shorter top list: its last ids ignored
      t.ids.push_back(dropped ? -100 : order[e]);
      t.logprobs.push_back(dropped ? 0.0 : t.full[i * v + order[e]]);
    }
  }
  return t;
}

// The student's log-softmax rows from z = x . w in double.
std::vector<double> student_log_softmax(const std::vector<double>& x, const std::vector<double>& w, std::int64_t n,
                                        std::int64_t h, std::int64_t v) {
  std::vector<double> out(static_cast<std::size_t>(n * v));
  for (std::int64_t i = 0; i < n; ++i) {
    double m = -1e300;
    for (std::int64_t j = 0; j < v; ++j) {
      double z = 0;
      for (std::int64_t c = 0; c < h; ++c) z += x[i * h + c] * w[j * h + c];
      out[i * v + j] = z;
      m = std::max(m, z);
    }
    double s = 0;
    for (std::int64_t j = 0; j < v; ++j) s += std::exp(out[i * v + j] - m);
    for (std::int64_t j = 0; j < v; ++j) out[i * v + j] -= m + std::log(s);
  }
  return out;
}

// The loss as defined in distillation.hpp, from the student's full log-softmax.
double materialised_distill_loss(const std::vector<double>& logq, std::int64_t v, const teacher& t, std::int64_t k,
                                 const batch& b, double norm, lce::distill_tail tail, bool sequence_mean) {
  double loss = 0;
  for (std::int64_t i = 0; i < b.n(); ++i) {
    const double wi = b.w(i);
    if (wi == 0.0) continue;
    std::int64_t ns = 0;
    if (sequence_mean) {
      const auto s = b.seq_of(i);
      for (std::int64_t e = b.cu[s]; e < b.cu[s + 1]; ++e) ns += b.w(e) != 0.0;
    }
    const double c = sequence_mean ? wi / (norm * double(ns)) : wi / norm;
    double p_mass = 0, q_mass = 0, kl = 0;
    for (std::int64_t e = 0; e < k; ++e) {
      const auto id = t.ids[i * k + e];
      if (id == -100) continue;
      p_mass += std::exp(t.logprobs[i * k + e]);
      q_mass += std::exp(logq[i * v + id]);
    }
    for (std::int64_t e = 0; e < k; ++e) {
      const auto id = t.ids[i * k + e];
      if (id == -100) continue;
      const double lp = t.logprobs[i * k + e], p = std::exp(lp);
      if (tail == lce::distill_tail::bucket) kl += p * (lp - logq[i * v + id]);
      else kl += p / p_mass * (lp - std::log(p_mass) - logq[i * v + id]);
    }
    if (tail == lce::distill_tail::bucket) kl += (1 - p_mass) * (std::log(1 - p_mass) - std::log(1 - q_mass));
    loss += c * kl;
  }
  return loss;
}

struct problem {
  batch b;
  std::int64_t n = 0, h = 6, v = 17, k = 5;
  teacher t;
  std::vector<double> x, w;
  problem() : b(make_batch({5, 1, 0, 6}, 31, true)) {
    n = b.n();
    for (auto& id : b.targets)
      if (id != -100) id %= v;
    t = make_teacher(n, v, k, 33);
    std::mt19937_64 rng(35);
    std::normal_distribution<double> g(0.0, 0.7);
    x.resize(static_cast<std::size_t>(n * h));
    w.resize(static_cast<std::size_t>(v * h));
    for (auto& e : x) e = g(rng);
    for (auto& e : w) e = g(rng);
  }
};

}  // namespace

TEST_CASE("distillation: the loss equals KL(teacher || student) materialised in double; dX equals finite differences") {
  problem p;
  const std::int64_t n = p.n, h = p.h, v = p.v, k = p.k;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, double> op{lce::comm::single{}, lce::options{.chunk_tokens = 4}};
  const lce::matrix_view<const double> W{p.w.data(), v, h};
  const lce::matrix_view<const std::int64_t> ids{p.t.ids.data(), n, k};
  const lce::matrix_view<const double> teacher_lp{p.t.logprobs.data(), n, k};

  for (const auto tail : {lce::distill_tail::bucket, lce::distill_tail::renormalise}) {
    for (const auto reduction : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
      CAPTURE(int(tail));
      CAPTURE(int(reduction));
      const lce::distill_options opts{reduction, tail};
      const double norm = double(lce::count_loss_units(thrust::host, p.b.view(), n, reduction));
      std::vector<std::int64_t> seq_tokens(static_cast<std::size_t>(p.b.s()));
      const auto loss_at = [&](const std::vector<double>& xs, std::vector<double>* grad, std::vector<double>* lse) {
        std::vector<double> student(static_cast<std::size_t>(n * k)), ls(static_cast<std::size_t>(n));
        op.forward(lce::matrix_view<const double>{xs.data(), n, h}, W, ids,
                   lce::target_set_outputs<double>{{student.data(), n, k}, mv(ls), {}, {}});
        if (lse) *lse = ls;
        lce::distill_outputs<double> out;
        out.seq_tokens = mv(seq_tokens);
        if (grad) out.grad_logprobs = {grad->data(), n, k};
        return lce::distill_loss(thrust::host, p.b.view(),
                                 lce::distill_inputs<std::int64_t, const double>{
                                     ids, teacher_lp, lce::matrix_view<const double>{student.data(), n, k}},
                                 norm, out, opts);
      };
      std::vector<double> grad(static_cast<std::size_t>(n * k)), lse;
      const lce::distill_result r = loss_at(p.x, &grad, &lse);
      const auto logq = student_log_softmax(p.x, p.w, n, h, v);
      const double want = materialised_distill_loss(logq, v, p.t, k, p.b, norm, tail,
                                                    reduction == lce::loss_reduction::sequence_mean);
      CHECK(std::fabs(r.loss - want) < 1e-12 * (1 + std::fabs(want)));
      CHECK(r.loss > 0);
      CHECK(r.tokens > 0);
      CHECK(r.teacher_mass > 0);

      std::vector<double> dx(static_cast<std::size_t>(n * h)), dw(static_cast<std::size_t>(v * h), 0.0);
      op.backward(lce::matrix_view<const double>{p.x.data(), n, h}, W, ids, cv(lse),
                  lce::target_set_gradients<double>{{grad.data(), n, k}, {}, {}, {}},
                  lce::matrix_view<double>{dx.data(), n, h}, lce::matrix_view<double>{dw.data(), v, h});
      const double step = 1e-6;
      double worst = 0;
      for (std::int64_t e = 0; e < n * h; ++e) {
        auto xs = p.x;
        xs[e] += step;
        const double up = loss_at(xs, nullptr, nullptr).loss;
        xs[e] -= 2 * step;
        const double down = loss_at(xs, nullptr, nullptr).loss;
        worst = std::max(worst, std::fabs((up - down) / (2 * step) - dx[e]));
      }
      CHECK(worst < 1e-8);
    }
  }
}

TEST_CASE("distillation: with every id in the set the bucket loss is the full KL; the bucket never exceeds it") {
  problem p;
  const std::int64_t n = p.n, v = p.v, h = p.h;
  const auto logq = student_log_softmax(p.x, p.w, n, h, v);
  const auto full_kl = [&](std::int64_t i) {
    double kl = 0;
    for (std::int64_t j = 0; j < v; ++j) kl += std::exp(p.t.full[i * v + j]) * (p.t.full[i * v + j] - logq[i * v + j]);
    return kl;
  };
  for (const std::int64_t k : {v, std::int64_t{3}}) {
    CAPTURE(k);
    // Every token counts with weight 1, one sequence.
    std::vector<std::int64_t> ids, targets(static_cast<std::size_t>(n), 0);
    std::vector<double> teacher_lp, student_lp;
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<std::int64_t> order(static_cast<std::size_t>(v));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](auto a, auto b) { return p.t.full[i * v + a] > p.t.full[i * v + b]; });
      for (std::int64_t e = 0; e < k; ++e) {
        ids.push_back(order[e]);
        teacher_lp.push_back(p.t.full[i * v + order[e]]);
        student_lp.push_back(logq[i * v + order[e]]);
      }
    }
    lce::packed_tokens<std::int64_t, std::int64_t> batch{{targets.data(), n}, {}, {}, -100};
    const auto r = lce::distill_loss(thrust::host, batch,
                                     lce::distill_inputs<std::int64_t, const double>{
                                         {ids.data(), n, k}, {teacher_lp.data(), n, k}, {student_lp.data(), n, k}},
                                     1.0, lce::distill_outputs<double>{});
    double full = 0;
    for (std::int64_t i = 0; i < n; ++i) full += full_kl(i);
    if (k == v) CHECK(std::fabs(r.loss - full) < 1e-9 * (1 + full));
    else CHECK(r.loss < full);
  }
}

TEST_CASE("distillation: bad input raises lce::error naming it, outputs untouched; nothing counted gives 0") {
  problem p;
  const std::int64_t n = p.n, k = p.k;
  std::vector<double> student(static_cast<std::size_t>(n * k), -3.0);
  std::vector<double> grad(static_cast<std::size_t>(n * k), 7.0);
  const auto before = grad;
  const auto run = [&](const std::vector<double>& teacher_lp, const std::vector<double>& student_lp, double norm,
                       std::int64_t grad_cols = -1) {
    return lce::distill_loss(thrust::host, p.b.view(),
                             lce::distill_inputs<std::int64_t, const double>{
                                 {p.t.ids.data(), n, k}, {teacher_lp.data(), n, k}, {student_lp.data(), n, k}},
                             norm, lce::distill_outputs<double>{{grad.data(), n, grad_cols < 0 ? k : grad_cols}});
  };
  const double norm = double(lce::count_loss_units(thrust::host, p.b.view(), n, lce::loss_reduction::token_mean));
  // The first counted token and one of its ids.
  std::int64_t first = 0;  // a counted token with all K ids (make_teacher drops some at i % 4 == 3)
  while (p.b.w(first) == 0.0 || first % 4 == 3) ++first;
  auto bad = p.t.logprobs;
  bad[first * k] = 0.5;
  check_error([&] { run(bad, student, norm); }, "teacher_logprobs[" + std::to_string(first) + ", 0] = 0.5");
  bad = p.t.logprobs;
  bad[first * k] = std::nan("");
  check_error([&] { run(bad, student, norm); }, "is not a log-probability");
  bad = p.t.logprobs;
  for (std::int64_t e = 0; e < k; ++e) bad[first * k + e] = std::log(0.3);
  check_error([&] { run(bad, student, norm); }, "hold probability 1.5 > 1");
  auto bad_student = student;
  bad_student[first * k + 1] = -INFINITY;
  check_error([&] { run(p.t.logprobs, bad_student, norm); },
              "student_logprobs[" + std::to_string(first) + ", 1] = -inf");
  check_error([&] { run(p.t.logprobs, student, norm, k - 1); }, "grad_logprobs: [" + std::to_string(n) + ", 4]");
  check_error([&] { run(p.t.logprobs, student, 0.0); }, "normaliser is 0");
  // A repeated id would count the student's mass on it twice; absent ids (ignore_index) may repeat.
  const auto with_ids = [&](const std::vector<std::int64_t>& ids) {
    return lce::distill_loss(thrust::host, p.b.view(),
                             lce::distill_inputs<std::int64_t, const double>{
                                 {ids.data(), n, k}, {p.t.logprobs.data(), n, k}, {student.data(), n, k}},
                             norm, lce::distill_outputs<double>{{grad.data(), n, k}});
  };
  auto repeated = p.t.ids;
  repeated[first * k + 2] = repeated[first * k];
  check_error([&] { with_ids(repeated); }, "ids[" + std::to_string(first) + ", 2] = " +
                                               std::to_string(repeated[first * k]) + " repeats an earlier id of token " +
                                               std::to_string(first) + ": a token's K ids must be distinct");
  CHECK(grad == before);
  std::int64_t shorter = 3;  // make_teacher ignores the last two ids of every fourth token
  while (p.b.w(shorter) == 0.0) shorter += 4;
  CHECK(p.t.ids[shorter * k + k - 1] == -100);
  CHECK(p.t.ids[shorter * k + k - 2] == -100);
  CHECK(std::isfinite(with_ids(p.t.ids).loss));
  grad = before;

  // Nothing counted: loss 0, gradient 0, no NaN.
  std::vector<float> zero(static_cast<std::size_t>(n), 0.0f);
  lce::packed_tokens<std::int64_t, std::int64_t> none{{}, {}, {zero.data(), n}, -100};
  const auto r = lce::distill_loss(thrust::host, none,
                                   lce::distill_inputs<std::int64_t, const double>{
                                       {p.t.ids.data(), n, k}, {p.t.logprobs.data(), n, k}, {student.data(), n, k}},
                                   0.0, lce::distill_outputs<double>{{grad.data(), n, k}});
  CHECK(r.loss == 0.0);
  CHECK(r.tokens == 0);
  CHECK(std::all_of(grad.begin(), grad.end(), [](double g) { return g == 0.0; }));
}

TEST_CASE("distillation: float log-probs of every id give the full KL and its gradient -p; a top-K mass that "
          "underflows still renormalises; a student's mass over 1 or a teacher with none raises") {
  problem p;
  const std::int64_t n = p.n, v = p.v, h = p.h;
  const auto logq = student_log_softmax(p.x, p.w, n, h, v);
  // Every id of the vocabulary, in float: both tails are 1 - sum of V rounded exps, noise of
  // either sign, which the bucket must not read as masses.
  std::vector<std::int64_t> ids, targets(static_cast<std::size_t>(n), 0);
  std::vector<float> teacher_lp, student_lp;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < v; ++j) {
      ids.push_back((j * 7 + i) % v);  // a permutation per token
      teacher_lp.push_back(static_cast<float>(p.t.full[i * v + ids.back()]));
      student_lp.push_back(static_cast<float>(logq[i * v + ids.back()]));
    }
  lce::packed_tokens<std::int64_t, std::int64_t> batch{{targets.data(), n}, {}, {}, -100};
  std::vector<float> grad(static_cast<std::size_t>(n * v));
  const auto r = lce::distill_loss(thrust::host, batch,
                                   lce::distill_inputs<std::int64_t>{
                                       {ids.data(), n, v}, {teacher_lp.data(), n, v}, {student_lp.data(), n, v}},
                                   1.0, lce::distill_outputs<float>{{grad.data(), n, v}});
  double full = 0, worst = 0;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < v; ++j) {
      const std::size_t at = static_cast<std::size_t>(i * v + j);
      const double lt = p.t.full[i * v + ids[at]];
      full += std::exp(lt) * (lt - logq[i * v + ids[at]]);
      worst = std::max(worst, std::fabs(double(grad[at]) + std::exp(lt)));  // dKL/dlog q = -p
    }
  CHECK(std::fabs(r.loss - full) < 1e-5 * (1 + full));
  CHECK(worst < 1e-6);

  const auto one_token = [](std::vector<float> teacher, std::vector<float> student, lce::distill_tail tail,
                            std::vector<float>& g) {
    const auto k = static_cast<std::int64_t>(teacher.size());
    static const std::vector<std::int64_t> id_list{0, 1, 2, 3}, target{0};
    lce::packed_tokens<std::int64_t, std::int64_t> one{{target.data(), 1}, {}, {}, -100};
    g.assign(static_cast<std::size_t>(k), 7.0f);
    return lce::distill_loss(thrust::host, one,
                             lce::distill_inputs<std::int64_t>{{id_list.data(), 1, k}, {teacher.data(), 1, k},
                                                               {student.data(), 1, k}},
                             1.0, lce::distill_outputs<float>{{g.data(), 1, k}}, lce::distill_options{{}, tail});
  };
  // The teacher's top-2 mass e^-800 (1 + e^-1) underflows in double; renormalised it is
  // (0.731, 0.269) all the same.
  std::vector<float> g;
  const auto renormalised = one_token({-800.0f, -801.0f}, {-1.0f, -2.0f}, lce::distill_tail::renormalise, g);
  const double p0 = 1.0 / (1.0 + std::exp(-1.0)), p1 = 1.0 - p0;
  CHECK(renormalised.loss == doctest::Approx(p0 * (std::log(p0) + 1.0) + p1 * (std::log(p1) + 2.0)).epsilon(1e-6));
  CHECK(g[0] == doctest::Approx(-p0).epsilon(1e-6));
  CHECK(g[1] == doctest::Approx(-p1).epsilon(1e-6));
  // The same teacher in the bucket: its tail is everything, against the student's 1 - e^-1 - e^-2.
  const auto bucket = one_token({-800.0f, -801.0f}, {-1.0f, -2.0f}, lce::distill_tail::bucket, g);
  const double student_tail = 1.0 - std::exp(-1.0) - std::exp(-2.0);
  CHECK(bucket.loss == doctest::Approx(-std::log(student_tail)).epsilon(1e-6));
  CHECK(g[0] == doctest::Approx(std::exp(-1.0) / student_tail).epsilon(1e-5));

  check_error([&] { one_token({-2.0f, -2.0f}, {std::log(0.6f), std::log(0.6f)}, lce::distill_tail::bucket, g); },
              "student_logprobs: the top-K of token 0 hold probability 1.2");
  CHECK(g == std::vector<float>{7.0f, 7.0f});  // untouched (one_token refilled it with 7s)
  check_error([&] { one_token({-INFINITY, -INFINITY}, {-1.0f, -2.0f}, lce::distill_tail::renormalise, g); },
              "teacher_logprobs: every log-prob of token 0 is -inf");
  CHECK(g == std::vector<float>{7.0f, 7.0f});
  // The bucket takes that teacher: all of it is tail.
  CHECK(one_token({-INFINITY, -INFINITY}, {-1.0f, -2.0f}, lce::distill_tail::bucket, g).loss ==
        doctest::Approx(-std::log(student_tail)).epsilon(1e-6));
}
