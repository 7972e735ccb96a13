// The x86 instruction set a CPU kernel runs with: the machine's, capped by the environment.
// Shared by the kernels that pick a SIMD path at run time (stream_linear, tree_attention).
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HS_HAVE_X86_SIMD 1
#include <immintrin.h>
#endif

namespace heterospec {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// Upper bound on the instruction set that the environment asks for. An emulated smaller CPU
// (bench/: MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2) must run our kernels as that CPU
// would, or the emulation measures a machine that does not exist. HETEROSPEC_CPU_SCALAR=1 forces
// the portable loops (what non-x86 machines run), as for the other CPU kernels.
inline Isa env_isa_cap() {
  Isa cap = Isa::Avx512;
  const char* scalar = std::getenv("HETEROSPEC_CPU_SCALAR");
  if (scalar != nullptr && scalar[0] == '1') return Isa::Scalar;
  for (const char* var : {"MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"}) {
    const char* v = std::getenv(var);
    if (v == nullptr || v[0] == '\0') continue;
    std::string s(v);
    for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (s.rfind("AVX512", 0) == 0 || s == "ALL" || s.rfind("AVX10", 0) == 0) continue;
    cap = std::min(cap, s.rfind("AVX2", 0) == 0 ? Isa::Avx2 : Isa::Scalar);
  }
  return cap;
}

inline Isa machine_isa() {
#ifdef HS_HAVE_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::Avx512;
  // (F16C: the float16 weights of stream_linear; every AVX2 CPU has it)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#endif
  return Isa::Scalar;
}

// Read once per process, like the entropy kernel's switch.
inline Isa active_isa() {
  static const Isa isa = std::min(machine_isa(), env_isa_cap());
  return isa;
}

}  // namespace heterospec
