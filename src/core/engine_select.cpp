// Engine selection: the handle's device type and the ENGINE attribute decide which engine
// serves a handle: the CPU reference engine serves CPU handles, the cuBLASLt engine CUDA
// handles (AUTO picks it; the fused engine is not built yet).
#include "core/engine.hpp"
#include "cuda/device.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {

std::unique_ptr<Engine> create_engine(LayerConfig& cfg) {
  if (cfg.device_type == kDeviceCpu) {
    if (cfg.engine != EngineKind::kAuto && cfg.engine != EngineKind::kCpu)
      fail(Status::kInvalidArgument, "engine %d is a CUDA engine but device_type is CPU", static_cast<int>(cfg.engine));
    if (cfg.device_id != -1 && cfg.device_id != 0)
      fail(Status::kInvalidArgument, "device_id %d is not valid for the CPU (use 0 or -1)", cfg.device_id);
    cfg.device_id = 0;
    cfg.engine = EngineKind::kCpu;
    return make_cpu_engine(cfg);
  }
  // CUDA device.
  if (cfg.engine == EngineKind::kCpu)
    fail(Status::kInvalidArgument, "engine CPU needs device_type CPU");
  if (!cuda::built_with_cuda())
    fail(Status::kArchMismatch, "device_type CUDA requested, but this build of libmoeblaze has no CUDA support");
  int32_t n = cuda::device_count();
  if (n == 0) fail(Status::kArchMismatch, "device_type CUDA requested, but no CUDA device is visible");
  if (cfg.device_id < 0) cfg.device_id = cuda::current_device();
  cuda::DeviceInfo info = cuda::device_info(cfg.device_id);
  if (!cuda::has_kernels_for(info.sm_major, info.sm_minor))
    fail(Status::kArchMismatch, "CUDA device %d (%s, sm_%d%d) has no kernels in this build (built for %s)", cfg.device_id,
         info.name, info.sm_major, info.sm_minor, "sm_80, sm_90a");
  if (cfg.engine == EngineKind::kCudaFused)
    fail(Status::kNotSupported, "the fused CUDA engine is not in this version; use ENGINE_AUTO or ENGINE_CUDA_CUBLASLT");
  cfg.engine = EngineKind::kCudaCublasLt;
  return make_cuda_engine(cfg);
}

}  // namespace v0
}  // namespace moeblaze
