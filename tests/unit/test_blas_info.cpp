// lce::blas_info(): the loaded CBLAS, its kernels, the CPU, and the advice when the
// kernels are slower than the CPU allows (OpenBLAS 0.3.21 runs SSE3 "Prescott" kernels
// on CPU models it does not know).
#include <lce/host/blas_info.hpp>
#include <lce/lce.hpp>  // links lce's GEMMs, so the BLAS is loaded

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace {

lce::cpu_features cpu_of_tier(int tier) {
  lce::cpu_features f;
  f.avx = tier >= 1;
  f.avx2 = f.fma = tier >= 2;
  f.avx512f = f.avx512bw = f.avx512dq = f.avx512vl = tier >= 3;
  return f;
}

lce::blas_report openblas(const char* core, int cpu_tier, const char* config = "OpenBLAS 0.3.21 DYNAMIC_ARCH") {
  lce::blas_report r;
  r.vendor = lce::blas_vendor::openblas, r.name = "OpenBLAS";
  r.kernels = core, r.version = config;
  r.coretype_settable = r.version.find("DYNAMIC_ARCH") != std::string::npos;
  r.cpu = cpu_of_tier(cpu_tier);
  lce::blas_detail::recommend(r);
  return r;
}

// Sets (or unsets, value == nullptr) an environment variable for one scope.
struct scoped_env {
  std::string name, saved;
  bool had;
  scoped_env(const char* n, const char* value) : name(n), had(std::getenv(n) != nullptr) {
    if (had) saved = std::getenv(n);
    if (value) setenv(n, value, 1);
    else unsetenv(n);
  }
  ~scoped_env() {
    if (had) setenv(name.c_str(), saved.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

}  // namespace

TEST_CASE("blas_info: OpenBLAS kernel classes and the coretype to recommend") {
  CHECK(lce::blas_detail::openblas_kernel_tier("Prescott") == 0);
  CHECK(lce::blas_detail::openblas_kernel_tier("Nehalem") == 0);
  CHECK(lce::blas_detail::openblas_kernel_tier("Sandybridge") == 1);
  CHECK(lce::blas_detail::openblas_kernel_tier("Haswell") == 2);
  CHECK(lce::blas_detail::openblas_kernel_tier("Zen") == 2);
  CHECK(lce::blas_detail::openblas_kernel_tier("SkylakeX") == 3);
  CHECK(lce::blas_detail::openblas_kernel_tier("COOPERLAKE") == 3);
  CHECK(lce::blas_detail::openblas_kernel_tier("NEOVERSEN1") == -1);
  CHECK(lce::blas_detail::openblas_kernel_tier("Prescot") == -1);

  SUBCASE("SSE kernels on an AVX-512 CPU: slow, SkylakeX") {
    const auto r = openblas("Prescott", 3);
    CHECK(r.slow);
    CHECK(r.recommended_coretype == "SkylakeX");
    CHECK(r.advice().find("OPENBLAS_CORETYPE=SkylakeX") != std::string::npos);
    CHECK(r.warning().find("several times") != std::string::npos);
    CHECK(r.line().find("SLOW") != std::string::npos);
  }
  SUBCASE("Haswell kernels on an AVX-512 CPU: slow, SkylakeX, up to 2x") {
    const auto r = openblas("Haswell", 3);
    CHECK(r.slow);
    CHECK(r.recommended_coretype == "SkylakeX");
    CHECK(r.warning().find("up to 2x") != std::string::npos);
  }
  SUBCASE("Nehalem on AVX2: Haswell; Sandybridge kernels on an AVX CPU: fine") {
    CHECK(openblas("Nehalem", 2).recommended_coretype == "Haswell");
    CHECK_FALSE(openblas("Sandybridge", 1).slow);
  }
  SUBCASE("the right kernels: nothing to say") {
    for (const char* core : {"SkylakeX", "Cooperlake"}) {
      const auto r = openblas(core, 3);
      CHECK_FALSE(r.slow);
      CHECK(r.recommended_coretype.empty());
      CHECK(r.warning().empty());
      CHECK(r.line().find("SLOW") == std::string::npos);
    }
    CHECK_FALSE(openblas("Zen", 2).slow);
    CHECK_FALSE(openblas("Haswell", 2).slow);
    CHECK_FALSE(openblas("Prescott", 0).slow);  // an SSE-only CPU
    CHECK_FALSE(openblas("ARMV8", 3).slow);     // names not known here: no advice
  }
  SUBCASE("an OpenBLAS that is not DYNAMIC_ARCH ignores OPENBLAS_CORETYPE") {
    const auto r = openblas("Prescott", 3, "OpenBLAS 0.3.21 NO_LAPACKE");
    CHECK(r.slow);
    CHECK_FALSE(r.coretype_settable);
    CHECK(r.advice().find("not DYNAMIC_ARCH") != std::string::npos);
  }
  SUBCASE("BLIS's haswell kernels on an AVX-512 CPU") {
    lce::blas_report r;
    r.vendor = lce::blas_vendor::blis, r.kernels = "haswell", r.cpu = cpu_of_tier(3);
    lce::blas_detail::recommend(r);
    CHECK(r.slow);
    CHECK(r.recommended_coretype.empty());
    r.kernels = "skx";
    lce::blas_detail::recommend(r);
    CHECK_FALSE(r.slow);
  }
}

TEST_CASE("blas_info: this process's BLAS and CPU") {
  const lce::blas_report r = lce::blas_info();
  MESSAGE(r.line());
#if defined(LCE_BLAS_OPENBLAS)
  REQUIRE(r.vendor == lce::blas_vendor::openblas);
  CHECK(r.version.rfind("OpenBLAS", 0) == 0);
  CHECK_FALSE(r.kernels.empty());
  CHECK(r.threads >= 1);
  CHECK(r.line().find(r.kernels) != std::string::npos);
  // What OPENBLAS_CORETYPE asked for is what runs (scripts/test.sh runs the suite
  // with the coretype scripts/blas-coretype.sh picks).
  // (Only names every OpenBLAS takes: 0.3.21 does not take "Cooperlake" by name.)
  if (const char* want = std::getenv("OPENBLAS_CORETYPE"))
    for (const char* name : {"SkylakeX", "Haswell", "Sandybridge", "Prescott"})
      if (strcasecmp(want, name) == 0) CHECK(strcasecmp(r.kernels.c_str(), want) == 0);
#elif defined(LCE_BLAS_BLIS)
  CHECK(r.vendor == lce::blas_vendor::blis);
#elif defined(LCE_BLAS_MKL)
  CHECK(r.vendor == lce::blas_vendor::mkl);
#endif
  if (r.vendor != lce::blas_vendor::unknown) CHECK_FALSE(r.library.empty());
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  CHECK(r.cpu.avx2 == bool(__builtin_cpu_supports("avx2")));
  CHECK(r.cpu.avx512f == bool(__builtin_cpu_supports("avx512f")));
  CHECK(r.cpu.fma == bool(__builtin_cpu_supports("fma")));
  CHECK(r.cpu.simd_tier() >= 0);
  // bf16 GEMMs run natively only on bf16 instructions, and never when LCE_BF16_GEMM=widen
  // asks to widen; the description says the same.
  if (!r.cpu.avx512_bf16 && !(r.cpu.amx_tile && r.cpu.amx_bf16)) CHECK_FALSE(r.bf16_gemm_native);
  if (const char* asked = std::getenv("LCE_BF16_GEMM"); asked && std::string_view(asked) == "widen")
    CHECK_FALSE(r.bf16_gemm_native);
  CHECK(r.bf16_gemm_native == (r.bf16_gemm.rfind("widened", 0) != 0));
#endif
}

TEST_CASE("check_blas_kernels: one line when slow, silenced by argument or LCE_NO_BLAS_WARNING") {
  const bool slow = lce::blas_info().slow;
  {
    scoped_env quiet("LCE_NO_BLAS_WARNING", nullptr);
    std::ostringstream out;
    CHECK(lce::check_blas_kernels(out) == slow);
    CHECK(out.str().empty() == !slow);
    if (slow) CHECK(out.str().find("lce: warning:") == 0);
    std::ostringstream off;
    CHECK(lce::check_blas_kernels(off, false) == slow);
    CHECK(off.str().empty());
  }
  for (const char* value : {"1", "yes"}) {
    scoped_env quiet("LCE_NO_BLAS_WARNING", value);
    std::ostringstream out;
    CHECK(lce::check_blas_kernels(out) == slow);
    CHECK(out.str().empty());
  }
  CHECK_FALSE(lce::blas_detail::env_flag("LCE_T_SURELY_UNSET_VARIABLE"));
  {
    scoped_env zero("LCE_T_FLAG", "0");
    CHECK_FALSE(lce::blas_detail::env_flag("LCE_T_FLAG"));
  }
  {
    scoped_env on("LCE_T_FLAG", "ON");
    CHECK(lce::blas_detail::env_flag("LCE_T_FLAG"));
  }
}

TEST_CASE("reexec_with_fast_blas: never when OPENBLAS_CORETYPE or LCE_NO_REEXEC is set") {
  char name[] = "lce_tests";
  char* argv[] = {name, nullptr};
  {
    scoped_env set("OPENBLAS_CORETYPE", "Prescott");
    CHECK_FALSE(lce::reexec_with_fast_blas(argv));
  }
  {
    scoped_env unset("OPENBLAS_CORETYPE", nullptr);
    scoped_env no("LCE_NO_REEXEC", "1");
    CHECK_FALSE(lce::reexec_with_fast_blas(argv));
  }
  CHECK_FALSE(lce::reexec_with_fast_blas(nullptr));
}

// The whole path, as lce's programs take it: a fresh process of this binary with no
// OPENBLAS_CORETYPE runs only the "child" case below, which calls reexec_with_fast_blas
// first thing; when its OpenBLAS runs slow kernels it restarts with the coretype set,
// and the restarted child checks that the kernels now match the CPU.
TEST_CASE("reexec_with_fast_blas: a fresh process restarts itself with fast kernels") {
#if defined(__linux__)
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    for (const char* drop : {"OPENBLAS_CORETYPE=", "LCE_BLAS_REEXEC=", "LCE_NO_REEXEC=", "LCE_T_REEXEC_CHILD="})
      if (kv.rfind(drop, 0) == 0) goto skip;
    env_text.push_back(kv);
  skip:;
  }
  env_text.push_back("LCE_T_REEXEC_CHILD=1");
  std::vector<char*> envp;
  for (auto& kv : env_text) envp.push_back(kv.data());
  envp.push_back(nullptr);
  char a0[] = "lce_tests", a1[] = "--test-case=blas_info: re-executed child", a2[] = "--minimal=true";
  char* child_argv[] = {a0, a1, a2, nullptr};

  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execve("/proc/self/exe", child_argv, envp.data());
    _exit(127);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
#endif
}

TEST_CASE("blas_info: re-executed child") {
  if (!lce::blas_detail::env_flag("LCE_T_REEXEC_CHILD")) return;  // only as the case above's child
#if defined(__linux__)
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(cmdline), std::istreambuf_iterator<char>()};
  std::vector<std::string> args;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = text.find('\0', at);
    args.push_back(text.substr(at, end - at));
    at = end == std::string::npos ? text.size() : end + 1;
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  const bool restarted = std::getenv("LCE_BLAS_REEXEC") != nullptr;
  CHECK_FALSE(lce::reexec_with_fast_blas(argv.data()));  // returns only when there is nothing (more) to do
  const lce::blas_report r = lce::blas_info();
  MESSAGE(r.line());
  if (r.vendor == lce::blas_vendor::openblas && r.coretype_settable) CHECK_FALSE(r.slow);
  CHECK(r.coretype_from_reexec == restarted);
  if (restarted) CHECK(r.kernels == r.coretype_env);
#endif
}
