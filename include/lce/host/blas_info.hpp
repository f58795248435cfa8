#pragma once
// Which CBLAS this process runs, which kernels it picked, and whether they are
// slower than the CPU allows.
//
//   lce::blas_report r = lce::blas_info();   // what is loaded, what the CPU has
//   std::puts(r.line().c_str());             // "BLAS: OpenBLAS 0.3.21 ..., kernels SkylakeX, ..."
//   lce::check_blas_kernels(std::cerr);      // one warning line when the kernels are slow
//   lce::reexec_with_fast_blas(argv);        // programs: restart once with OPENBLAS_CORETYPE
//
// lce's GEMMs are all the BLAS's: an OpenBLAS that does not know the CPU model
// (0.3.21 on Emerald Rapids, say) falls back to its SSE3 "Prescott" kernels and
// runs sgemm ~5x below what the same library reaches with OPENBLAS_CORETYPE=SkylakeX.
// lce's own timings, relative to its GEMMs, cannot show that; this header can.
//
// The library is found at run time (dlsym of cblas_sgemm and of each vendor's
// query functions), so it tells what is really loaded, whatever cblas.h was
// compiled against: OpenBLAS (openblas_get_config / openblas_get_corename),
// BLIS (bli_info_get_version_str / bli_arch_string) or MKL (MKL_Get_Version).
// It needs nothing of lce but config.hpp and, for its bf16_gemm line, the bf16 GEMM
// choice. lce's default GEMM provider (cblas_gemm.hpp) includes it for the one-time
// warning below.

#include <lce/core/config.hpp>
#include <lce/host/detail/bf16_gemm_choice.hpp>

#include <strings.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <ostream>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <unistd.h>
#define LCE_BLAS_INFO_HAVE_DLFCN 1
#endif
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define LCE_BLAS_INFO_X86 1
#endif

LCE_BEGIN_NAMESPACE

// CPU features that decide which GEMM kernels can run (x86; all false elsewhere).
// Each is set only when the CPU has it and the OS saves its registers (XCR0).
struct cpu_features {
  std::string vendor;        // "GenuineIntel", "AuthenticAMD", ... ("" if unknown)
  int family = 0, model = 0; // display family and model (cpuid leaf 1)
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512_bf16 = false, amx_tile = false, amx_bf16 = false;

  // The widest GEMM kernel class the CPU runs: 0 SSE only, 1 AVX, 2 AVX2+FMA, 3 AVX-512 (F, BW, DQ, VL).
  int simd_tier() const {
    if (avx512f && avx512bw && avx512dq && avx512vl) return 3;
    if (avx2 && fma) return 2;
    return avx ? 1 : 0;
  }
  // "avx2 avx512f avx512_bf16 amx" (the features present), or "sse only".
  std::string summary() const {
    std::string s;
    auto add = [&](bool on, const char* name) {
      if (on) s += (s.empty() ? "" : " "), s += name;
    };
    add(avx2 && fma, "avx2");
    add(avx512f, "avx512f");
    add(avx512_bf16, "avx512_bf16");
    add(amx_tile && amx_bf16, "amx");
    return s.empty() ? (avx ? "avx" : "sse only") : s;
  }
};

enum class blas_vendor { unknown, openblas, blis, mkl };

struct blas_report {
  blas_vendor vendor = blas_vendor::unknown;
  std::string name;      // "OpenBLAS", "BLIS", "MKL", or "unknown CBLAS"
  std::string library;   // file that provides cblas_sgemm (dladdr), "" if not found
  std::string version;   // openblas_get_config(), BLIS version, MKL version string
  std::string kernels;   // openblas_get_corename(), bli_arch_string(), MKL's processor path; "" if unknown
  int threads = -1;      // the BLAS's own thread count now (-1: unknown)
  cpu_features cpu;

  // Recommendation. `slow` when the kernel set is a lower SIMD class than the CPU runs.
  bool slow = false;
  int cpu_tier = -1, kernel_tier = -1;  // SIMD classes (cpu_features::simd_tier; -1: unknown)
  std::string reason;              // why slow, in words ("" when not slow)
  std::string recommended_coretype;  // OpenBLAS: the OPENBLAS_CORETYPE to set ("" if none helps)
  bool coretype_settable = false;  // OpenBLAS built DYNAMIC_ARCH: OPENBLAS_CORETYPE takes effect
  std::string coretype_env;        // OPENBLAS_CORETYPE in this process's environment ("" if unset)
  bool coretype_from_reexec = false; // set by lce::reexec_with_fast_blas before this run

  // What runs the host backend's GEMMs for a bfloat16 weight (LCE_BF16_GEMM): "oneDNN
  // 2.6.3, brg:avx512_core_amx_bf16" (bf16 instructions, fp32 accumulation), or
  // "widened to fp32 for the BLAS" (without oneDNN, or on a CPU without bf16 GEMMs).
  std::string bf16_gemm;
  // Whether those GEMMs run on the CPU's bf16 instructions (AMX, or oneDNN on
  // AVX512-BF16) rather than widened to fp32. Only then does
  // lce::host_bf16_operands buy speed: elsewhere it widens inside each GEMM and
  // rounds dz to bf16 for nothing, so choose lce::host (see the README).
  bool bf16_gemm_native = false;

  // One line for logs: library, version, kernels, how they were chosen, CPU, and a
  // warning with the fix when the kernels are slow.
  std::string line() const;
  // What to do about slow kernels, e.g. "set OPENBLAS_CORETYPE=SkylakeX before the
  // program starts" ("" when not slow).
  std::string advice() const;
  // The warning line check_blas_kernels prints ("" when not slow).
  std::string warning() const;
};

namespace blas_detail {

// SIMD class of an OpenBLAS x86-64 kernel set (the names openblas_get_corename()
// returns): 0 SSE, 1 AVX, 2 AVX2, 3 AVX-512; -1 for names not known here (other
// architectures, future names), for which nothing is recommended.
inline int openblas_kernel_tier(const std::string& core) {
  static const char* const sse[] = {"Katmai",  "Coppermine", "Northwood",    "Prescott",  "Banias", "Atom",
                                     "Core2",   "Penryn",     "Dunnington",   "Nehalem",   "Athlon", "Opteron",
                                     "Opteron_SSE3", "Barcelona", "Nano", "Bobcat"};
  static const char* const avx[] = {"Sandybridge", "Bulldozer", "Piledriver", "Steamroller", "Excavator"};
  static const char* const avx2[] = {"Haswell", "Zen"};
  static const char* const avx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
  auto in = [&](const auto& names) {
    for (const char* n : names)
      if (core.size() == std::strlen(n) && strncasecmp(core.c_str(), n, core.size()) == 0) return true;
    return false;
  };
  if (in(avx512)) return 3;
  if (in(avx2)) return 2;
  if (in(avx)) return 1;
  if (in(sse)) return 0;
  return -1;
}

// The OPENBLAS_CORETYPE for a CPU of this class: names that every DYNAMIC_ARCH
// OpenBLAS since 0.3.x accepts by name. (SkylakeX, not Cooperlake: OpenBLAS 0.3.21
// leaves "Cooperlake" out of its name lookup, warns "Core not found", and its sgemm and
// dgemm kernels are SkylakeX's anyway.)
inline const char* openblas_coretype_for(int cpu_tier) {
  switch (cpu_tier) {
    case 3: return "SkylakeX";
    case 2: return "Haswell";
    case 1: return "Sandybridge";
    default: return "";
  }
}

inline const char* tier_name(int tier) {
  switch (tier) {
    case 3: return "AVX-512";
    case 2: return "AVX2";
    case 1: return "AVX";
    case 0: return "SSE";
    default: return "?";
  }
}

// Fills slow / reason / recommended_coretype from vendor, kernels and cpu.
inline void recommend(blas_report& r) {
  r.slow = false, r.reason.clear(), r.recommended_coretype.clear();
  const int cpu_tier = r.cpu_tier = r.cpu.simd_tier();
  if (r.vendor == blas_vendor::openblas) {
    const int kernel_tier = r.kernel_tier = openblas_kernel_tier(r.kernels);
    if (kernel_tier < 0 || kernel_tier >= cpu_tier) return;
    r.slow = true;
    r.recommended_coretype = openblas_coretype_for(cpu_tier);
    r.reason = "OpenBLAS runs its " + r.kernels + " (" + tier_name(kernel_tier) + ") kernels on an " +
               tier_name(cpu_tier) + " CPU";
  } else if (r.vendor == blas_vendor::blis) {
    // BLIS names its kernel sets by microarchitecture; the x86-64 ones by class.
    const std::string& k = r.kernels;
    const int kernel_tier = (k == "skx" || k == "knl")                                     ? 3
                            : (k == "haswell" || k.rfind("zen", 0) == 0)                   ? 2
                            : (k == "sandybridge" || k == "bulldozer" || k == "piledriver" ||
                               k == "steamroller" || k == "excavator")                     ? 1
                            : (k == "penryn" || k == "generic")                            ? 0
                                                                                           : -1;
    r.kernel_tier = kernel_tier;
    if (kernel_tier < 0 || kernel_tier >= cpu_tier) return;
    r.slow = true;
    r.reason = "BLIS runs its " + k + " (" + tier_name(kernel_tier) + ") kernels on an " + tier_name(cpu_tier) +
               " CPU";
  }
}

#if defined(LCE_BLAS_INFO_X86)
inline unsigned long long xcr0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

inline cpu_features detect_cpu() {
  cpu_features f;
#if defined(LCE_BLAS_INFO_X86)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  f.vendor = vendor;
  __get_cpuid(1, &a, &b, &c, &d);
  const unsigned base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
  f.family = int(base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family);
  f.model = int(base_family == 0x6 || base_family == 0xf ? base_model | (((a >> 16) & 0xf) << 4) : base_model);
  const bool osxsave = (c >> 27) & 1, has_avx = (c >> 28) & 1, has_fma = (c >> 12) & 1;
  const unsigned long long xcr = osxsave ? xcr0() : 0;
  const bool os_ymm = (xcr & 0x6) == 0x6, os_zmm = os_ymm && (xcr & 0xe0) == 0xe0;
  const bool os_amx = (xcr & 0x60000) == 0x60000;
  f.avx = has_avx && os_ymm;
  f.fma = has_fma && os_ymm;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = ((b >> 5) & 1) && os_ymm;
    f.avx512f = ((b >> 16) & 1) && os_zmm;
    f.avx512dq = ((b >> 17) & 1) && os_zmm;
    f.avx512bw = ((b >> 30) & 1) && os_zmm;
    f.avx512vl = ((b >> 31) & 1) && os_zmm;
    f.amx_bf16 = ((d >> 22) & 1) && os_amx;
    f.amx_tile = ((d >> 24) & 1) && os_amx;
    const unsigned subleaves = a;
    if (subleaves >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512_bf16 = ((a >> 5) & 1) && os_zmm;
    }
  }
#endif
  return f;
}

#if defined(LCE_BLAS_INFO_HAVE_DLFCN)
template <class F>
F find(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}
#endif

inline std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// "1", "yes", "true", "on" (any case): on; unset, "", "0", "no", "false", "off": off.
inline bool env_flag(const char* name) {
  const std::string v = env(name);
  if (v.empty()) return false;
  for (const char* off : {"0", "no", "false", "off"})
    if (strcasecmp(v.c_str(), off) == 0) return false;
  return true;
}

}  // namespace blas_detail

// What this process's CBLAS is and does. Cheap (a few dlsym calls and cpuid);
// call it after the BLAS is loaded (any time in a program linked against it).
inline blas_report blas_info() {
  blas_report r;
  r.cpu = blas_detail::detect_cpu();
  r.coretype_env = blas_detail::env("OPENBLAS_CORETYPE");
  r.coretype_from_reexec = !r.coretype_env.empty() && blas_detail::env("LCE_BLAS_REEXEC") == r.coretype_env;
  r.name = "unknown CBLAS";
#if defined(LCE_BLAS_INFO_HAVE_DLFCN)
  using namespace blas_detail;
  if (void* sgemm = dlsym(RTLD_DEFAULT, "cblas_sgemm")) {
    Dl_info where{};
    if (dladdr(sgemm, &where) && where.dli_fname) r.library = where.dli_fname;
  }
  if (auto corename = find<char* (*)()>("openblas_get_corename")) {
    r.vendor = blas_vendor::openblas, r.name = "OpenBLAS";
    if (const char* k = corename()) r.kernels = k;
    if (auto config = find<char* (*)()>("openblas_get_config"))
      if (const char* c = config()) r.version = c;
    if (auto threads = find<int (*)()>("openblas_get_num_threads")) r.threads = threads();
    r.coretype_settable = r.version.find("DYNAMIC_ARCH") != std::string::npos;
  } else if (auto version = find<const char* (*)()>("bli_info_get_version_str")) {
    r.vendor = blas_vendor::blis, r.name = "BLIS";
    if (const char* v = version()) r.version = v;
    auto arch_id = find<int (*)()>("bli_arch_query_id");
    auto arch_name = find<const char* (*)(int)>("bli_arch_string");
    if (arch_id && arch_name)
      if (const char* k = arch_name(arch_id())) r.kernels = k;
    if (auto threads = find<long long (*)()>("bli_thread_get_num_threads")) r.threads = int(threads());
  } else if (auto mkl_version = find<void (*)(void*)>("MKL_Get_Version")) {
    r.vendor = blas_vendor::mkl, r.name = "MKL";
    struct {  // MKLVersion (mkl_types.h)
      int major, minor, update, patch;
      char *status, *build, *processor, *platform;
    } v{};
    mkl_version(&v);
    r.version = std::to_string(v.major) + "." + (v.minor ? std::to_string(v.minor) + "." : "") +
                std::to_string(v.update);  // oneMKL: 2026.2 (minor 0)
    // The code path MKL dispatched to, from its long processor string.
    const std::string path = v.processor ? v.processor : "";
    for (const char* isa : {"AVX-512", "AVX2", "AVX", "SSE4.2"})
      if (path.find(isa) != std::string::npos) {
        r.kernels = isa;
        break;
      }
    if (path.find("AMX") != std::string::npos) r.kernels += r.kernels.empty() ? "AMX" : "+AMX";
    if (auto threads = find<int (*)()>("MKL_Get_Max_Threads")) r.threads = threads();
  }
#endif
  blas_detail::recommend(r);
  r.bf16_gemm = detail::bf16_gemm_description(detail::chosen_bf16_gemm_kernel());
  r.bf16_gemm_native = detail::bf16_gemm_runs_natively();
  return r;
}

inline std::string blas_report::advice() const {
  if (!slow) return {};
  if (vendor == blas_vendor::openblas && !recommended_coretype.empty()) {
    if (!coretype_settable)
      return "this OpenBLAS is not DYNAMIC_ARCH (it ignores OPENBLAS_CORETYPE): install one built for this CPU";
    if (!coretype_env.empty())
      return "OPENBLAS_CORETYPE=" + coretype_env + " is set: set OPENBLAS_CORETYPE=" + recommended_coretype;
    return "set OPENBLAS_CORETYPE=" + recommended_coretype + " in the environment before the program starts";
  }
  if (vendor == blas_vendor::blis) return "configure lce with -DLCE_BLAS=openblas (and the OPENBLAS_CORETYPE it needs)";
  return {};
}

inline std::string blas_report::warning() const {
  if (!slow) return {};
  const std::string fix = advice();
  const int gap = cpu_tier - kernel_tier;
  return "lce: warning: " + reason + ", so GEMMs run " + (gap > 1 ? "several times" : "up to 2x") +
         " slower than this CPU allows" +
         (fix.empty() ? "" : "; " + fix) + " (LCE_NO_BLAS_WARNING=1 hides this warning)";
}

inline std::string blas_report::line() const {
  std::string s = "BLAS: " + name;
  if (vendor == blas_vendor::openblas && version.rfind("OpenBLAS ", 0) == 0) {
    s = "BLAS: " + version.substr(0, version.find(' ', 9));  // "OpenBLAS 0.3.21"
  } else if (!version.empty()) {
    s += " " + version;
  }
  if (!library.empty()) s += " (" + library.substr(library.find_last_of('/') + 1) + ")";
  s += ", kernels " + (kernels.empty() ? std::string("unknown") : kernels);
  if (vendor == blas_vendor::openblas) {
    if (coretype_env.empty()) s += " (own choice)";
    else s += coretype_from_reexec ? " (OPENBLAS_CORETYPE=" + coretype_env + ", set by lce)"
                                   : " (OPENBLAS_CORETYPE=" + coretype_env + ")";
  }
  if (threads > 0) s += ", " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  s += "; CPU " + cpu.summary();
  if (!bf16_gemm.empty()) s += "; bf16 GEMMs: " + bf16_gemm;
  if (slow) s += " -- SLOW: " + reason + (advice().empty() ? "" : "; " + advice());
  return s;
}

// Prints report.warning() on `out` when the kernels are slow, unless `enabled` is
// false or LCE_NO_BLAS_WARNING is set (to anything but 0/no/false/off). Returns
// whether the kernels are slow (whether or not it printed).
inline bool check_blas_kernels(std::ostream& out, bool enabled = true) {
  const blas_report r = blas_info();
  if (r.slow && enabled && !blas_detail::env_flag("LCE_NO_BLAS_WARNING")) out << r.warning() << '\n';
  return r.slow;
}
inline bool check_blas_kernels() { return check_blas_kernels(std::cerr); }

namespace detail {
// lce's default GEMM provider (cblas_gemm) calls this as each operator call begins: the
// first call in the process prints check_blas_kernels' warning on std::cerr, so slow
// kernels are never silent for a library user who did not ask (LCE_NO_BLAS_WARNING=1
// hides it). Later calls cost one initialised-static check.
inline void warn_once_if_blas_kernels_slow() {
  static const bool checked = (check_blas_kernels(std::cerr), true);
  (void)checked;
}
}  // namespace detail

// For programs: when the BLAS is an OpenBLAS running slow kernels that
// OPENBLAS_CORETYPE can fix, and neither OPENBLAS_CORETYPE nor LCE_NO_REEXEC is
// set, sets OPENBLAS_CORETYPE to the recommended kernels and re-executes this
// program (/proc/self/exe, same argv, same pid), since OpenBLAS reads the variable
// only when it is loaded. Call it first thing in main(), before any threads, MPI_Init
// or output. Returns false when nothing was to be done or the exec failed (the
// program then goes on with the kernels it has); does not return when it re-executes.
// The variable stays set in the new process, so it never loops.
inline bool reexec_with_fast_blas(char** argv) {
#if defined(__linux__)
  if (argv == nullptr || argv[0] == nullptr) return false;
  if (std::getenv("OPENBLAS_CORETYPE") || blas_detail::env_flag("LCE_NO_REEXEC")) return false;
  const blas_report r = blas_info();
  if (!r.slow || r.vendor != blas_vendor::openblas || !r.coretype_settable || r.recommended_coretype.empty())
    return false;
  if (setenv("OPENBLAS_CORETYPE", r.recommended_coretype.c_str(), 1) != 0) return false;
  setenv("LCE_BLAS_REEXEC", r.recommended_coretype.c_str(), 1);
  std::cout.flush(), std::cerr.flush(), std::fflush(nullptr);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE"), unsetenv("LCE_BLAS_REEXEC");  // exec failed: carry on as we are
#else
  (void)argv;
#endif
  return false;
}

LCE_END_NAMESPACE
