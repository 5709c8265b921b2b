// The library's entry points: ONNX Runtime's RegisterCustomOps (the domain specbuild.kernels with every op of the
// library) and the instruction set the kernels chose, for the runtime to report.

#include <mutex>

#include "kernels.h"

extern "C" {

// The instruction set the kernels run with in this process ("avx512vnni", "avx2" or "scalar").
__attribute__((visibility("default"))) const char* SpecbuildKernelsIsa() {
  return specbuild_kernels::IsaName(specbuild_kernels::ChosenIsa());
}

// ONNX Runtime's entry point for a custom-op library (SessionOptions.register_custom_ops_library).
__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                    const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an ONNX Runtime older than the headers: ORT reports the unknown op
  Ort::InitApi(api);
  static Ort::CustomOpDomain* domain = nullptr;
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      domain = new Ort::CustomOpDomain("specbuild.kernels");  // lives as long as the process: sessions point into it
      specbuild_kernels::AddBlockInt4MatMul(*domain);
      specbuild_kernels::AddOrderedAttention(*domain);
    });
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}

}  // extern "C"
