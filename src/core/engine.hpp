// The engine interface: every engine (CPU reference, CUDA cuBLASLt, CUDA fused) implements
// it. Engines receive validated arguments and buffers already checked for size; they never
// see the C API. An engine is immutable after construction (handles are thread-safe).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/args.hpp"
#include "core/config.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {

class Engine {
 public:
  virtual ~Engine() = default;
  virtual EngineKind kind() const = 0;
  // Scratch bytes for a call; depends on the config and num_tokens only, monotone in L.
  virtual size_t workspace_size(Pass pass, int64_t num_tokens) const = 0;
  virtual void forward(Pass pass, const CallArgs& args, void* workspace, void* saved,
                       void* stream) const = 0;
  // last_use (moeblaze_backward_last_use): the caller's last use of `saved`, which the engine
  // may write over; it marks the buffer spent (spent_saved_header) after its last read.
  // Otherwise `saved` is only read.
  virtual void backward(const CallArgs& args, void* saved, bool last_use, void* workspace,
                        void* stream) const = 0;
  // Scratch bytes of a last-use backward; at most workspace_size(kBackward).
  virtual size_t last_use_workspace_size(int64_t num_tokens) const {
    return workspace_size(Pass::kBackward, num_tokens);
  }
  virtual void route(const CallArgs& args, void* workspace, void* stream) const = 0;
  // Saved bytes of a training forward of num_tokens: the shared layout (core/memory_layout),
  // unless the engine keeps more (the expert-parallel layer).
  virtual size_t saved_size(const LayerConfig& cfg, int64_t num_tokens) const {
    return carve_saved(cfg, num_tokens, nullptr).bytes;
  }
};

// Resolves the device and ENGINE attribute through the registry (src/engines/registry.cpp:
// AUTO picks the first engine of the device that can serve cfg), checks the device exists, and
// builds the engine. Writes the resolved choice back into cfg and, when decision is given,
// describes it there in one line (for the INFO log message of moeblaze_create).
std::unique_ptr<Engine> create_engine(LayerConfig& cfg, std::string* decision = nullptr);

// The engines' factories (src/engines/*).
std::unique_ptr<Engine> make_cpu_engine(const LayerConfig& cfg);
std::unique_ptr<Engine> make_cublaslt_engine(const LayerConfig& cfg);
std::unique_ptr<Engine> make_fused_engine(const LayerConfig& cfg);
// Why the fused engine cannot serve cfg on a device of compute capability sm_major.x, or nullptr.
const char* fused_engine_refuses(const LayerConfig& cfg, int sm_major);

}  // namespace v0
}  // namespace moeblaze
