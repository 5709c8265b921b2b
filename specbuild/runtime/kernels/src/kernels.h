// What the units of specbuild's kernel library share: ONNX Runtime's C++ API (initialised by RegisterCustomOps in
// register.cc), the instruction set the kernels run with, and each unit's function adding its ops to the domain.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdlib>
#include <string>

namespace specbuild_kernels {

// Paths by instruction set: AVX-512 with VNNI (and BW/VL), AVX2 with FMA, plain C++. Every kernel computes the same
// bits on each.
enum class Isa { kScalar, kAvx2, kAvx512Vnni };

inline Isa DetectIsa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return Isa::kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kScalar;
}

inline const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      return "avx512vnni";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// Which path a process takes: the CPU's best, unless SPECBUILD_KERNELS_ISA names a lower one (tests).
inline Isa ChosenIsa() {
  static const Isa isa = [] {
    Isa best = DetectIsa();
    const char* forced = std::getenv("SPECBUILD_KERNELS_ISA");
    if (forced == nullptr) return best;
    std::string name(forced);
    Isa want = name == "scalar" ? Isa::kScalar : name == "avx2" ? Isa::kAvx2 : best;
    return static_cast<int>(want) < static_cast<int>(best) ? want : best;
  }();
  return isa;
}

void AddBlockInt4MatMul(Ort::CustomOpDomain& domain);   // block_int4_matmul.cc
void AddOrderedAttention(Ort::CustomOpDomain& domain);  // ordered_attention.cc

}  // namespace specbuild_kernels
