// The engine registry: which engine serves a handle. A table in preference order; for each
// engine, the device it runs on, why it cannot serve a configuration (or nullptr), and its
// factory. AUTO takes the first entry of the handle's device that can serve it; an explicit
// ENGINE must be able to, or creation fails with its reason.
#include <cstdio>
#include <string>

#include "core/engine.hpp"
#include "cuda/device.hpp"
#include "gemm/sm90/heuristics.hpp"
#include "routing/selection.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {

#if !MOEBLAZE_WITH_CUDA
// Never reached (resolve_device refuses CUDA first); keeps the table free of #ifs.
std::unique_ptr<Engine> make_cublaslt_engine(const LayerConfig&) {
  fail(Status::kArchMismatch, "this build of libmoeblaze has no CUDA support");
}
std::unique_ptr<Engine> make_fused_engine(const LayerConfig&) {
  fail(Status::kArchMismatch, "this build of libmoeblaze has no CUDA support");
}
const char* fused_engine_refuses(const LayerConfig&, int) { return "this build of libmoeblaze has no CUDA support"; }
#endif

namespace {

const char* cpu_refuses(const LayerConfig&, const cuda::DeviceInfo*) { return nullptr; }

// The CUDA router takes up to routing::kMaxExpertGroupsCuda expert groups in a group limit.
const char* routing_refused(const LayerConfig& cfg) {
  const bool limited = cfg.topk_groups > 0 && cfg.topk_groups < cfg.num_expert_groups;
  return limited && cfg.num_expert_groups > routing::kMaxExpertGroupsCuda
             ? "group-limited routing (TOPK_GROUPS) on a GPU takes at most 256 expert groups (NUM_EXPERT_GROUPS)"
             : nullptr;
}

const char* fused_refuses(const LayerConfig& cfg, const cuda::DeviceInfo* info) {
  if (const char* why = routing_refused(cfg)) return why;
  return fused_engine_refuses(cfg, info ? info->sm_major : 0);
}

// AUTO's choice between the CUDA engines is a measured rule (gemm/sm90/heuristics.hpp).
bool fused_auto(const LayerConfig& cfg) {
  return gemm::sm90::fused_engine_auto(cfg.hidden, cfg.ffn_hidden, cfg.num_experts, cfg.top_k);
}
bool always(const LayerConfig&) { return true; }

const char* cublaslt_refuses(const LayerConfig& cfg, const cuda::DeviceInfo*) {
  if (const char* why = routing_refused(cfg)) return why;
  if (cfg.act_dtype != cfg.weight_dtype) return "it needs activation_dtype == weight_dtype";
  return nullptr;
}

struct EngineEntry {
  EngineKind kind;
  int32_t device_type;
  bool (*automatic)(const LayerConfig&);  // AUTO may pick it for this configuration
  const char* name;
  const char* (*refuses)(const LayerConfig&, const cuda::DeviceInfo*);
  std::unique_ptr<Engine> (*make)(const LayerConfig&);
};

// Preference order within a device. The fused engine (the one that captures in CUDA graphs and
// never syncs) comes first where AUTO may take it (fused_auto); an explicit ENGINE takes it
// wherever it can serve.
const EngineEntry kEngines[] = {
    {EngineKind::kCpu, kDeviceCpu, always, "cpu", cpu_refuses, make_cpu_engine},
    {EngineKind::kCudaFused, kDeviceCuda, fused_auto, "cuda_fused", fused_refuses, make_fused_engine},
    {EngineKind::kCudaCublasLt, kDeviceCuda, always, "cuda_cublaslt", cublaslt_refuses, make_cublaslt_engine},
};

// Checks the device itself; returns its properties for CUDA (nullptr for the CPU).
const cuda::DeviceInfo* resolve_device(LayerConfig& cfg, cuda::DeviceInfo& info) {
  if (cfg.device_type == kDeviceCpu) {
    if (cfg.device_id != -1 && cfg.device_id != 0)
      fail(Status::kInvalidArgument, "device_id %d is not valid for the CPU (use 0 or -1)", cfg.device_id);
    cfg.device_id = 0;
    return nullptr;
  }
  if (!cuda::built_with_cuda())
    fail(Status::kArchMismatch, "device_type CUDA requested, but this build of libmoeblaze has no CUDA support");
  if (cuda::device_count() == 0) fail(Status::kArchMismatch, "device_type CUDA requested, but no CUDA device is visible");
  if (cfg.device_id < 0) cfg.device_id = cuda::current_device();
  info = cuda::device_info(cfg.device_id);
  if (!cuda::has_kernels_for(info.sm_major, info.sm_minor))
    fail(Status::kArchMismatch, "CUDA device %d (%s, sm_%d%d) has no kernels in this build (built for %s)", cfg.device_id,
         info.name, info.sm_major, info.sm_minor, "sm_80, sm_90a and compute_80 PTX: sm_80 and newer");
  return &info;
}

}  // namespace

std::unique_ptr<Engine> create_engine(LayerConfig& cfg, std::string* decision) {
  for (const EngineEntry& e : kEngines)
    if (cfg.engine == e.kind && cfg.device_type != e.device_type)
      fail(Status::kInvalidArgument, "engine %s does not run on device_type %d", e.name, cfg.device_type);
  cuda::DeviceInfo storage{};
  const cuda::DeviceInfo* info = resolve_device(cfg, storage);
  const bool automatic = cfg.engine == EngineKind::kAuto;
  std::string why;
  for (const EngineEntry& e : kEngines) {
    if (e.device_type != cfg.device_type) continue;
    if (automatic ? !e.automatic(cfg) : cfg.engine != e.kind) continue;
    if (const char* reason = e.refuses(cfg, info)) {
      why += std::string(why.empty() ? "" : "; ") + e.name + ": " + reason;
      continue;
    }
    cfg.engine = e.kind;  // the resolved choice, read back through the handle getters
    if (decision) {
      char where[320];
      if (info)
        snprintf(where, sizeof where, "CUDA device %d (%s, sm_%d%d)", cfg.device_id, info->name, info->sm_major,
                 info->sm_minor);
      else
        snprintf(where, sizeof where, "the CPU");
      *decision = std::string("engine ") + e.name + " on " + where + (automatic ? ", chosen by AUTO" : ", as requested");
      if (!why.empty()) *decision += " (passed over: " + why + ")";
    }
    return e.make(cfg);
  }
  fail(Status::kNotSupported, "no engine can serve this configuration (%s)", why.c_str());
}

}  // namespace v0
}  // namespace moeblaze
