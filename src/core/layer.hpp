// A Layer is what a handle holds: the validated config and its engine. It checks buffers
// (presence, alignment, size) before handing validated arguments to the engine.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/args.hpp"
#include "core/config.hpp"
#include "core/engine.hpp"

namespace moeblaze {
inline namespace v0 {

class Layer {
 public:
  explicit Layer(const ConfigValues& values);
  // A layer whose engine was made elsewhere (the expert-parallel layer: engines/ep).
  Layer(const LayerConfig& cfg, std::unique_ptr<Engine> engine, std::string decision)
      : cfg_(cfg), engine_(std::move(engine)), decision_(std::move(decision)) {}
  const LayerConfig& config() const { return cfg_; }
  const Engine& engine() const { return *engine_; }
  // What create decided (engine, device, why others were passed over), one line.
  const std::string& decision() const { return decision_; }

  size_t workspace_size(Pass pass, int64_t num_tokens) const;
  size_t saved_size(int64_t num_tokens) const;

  CallArgs check(Pass pass, const RawArg* args, size_t num_args) const;
  void forward(Pass pass, const RawArg* args, size_t num_args, void* workspace, size_t workspace_bytes, void* saved,
               size_t saved_bytes, void* stream) const;
  // last_use: moeblaze_backward_last_use (saved may be written over; Engine::backward).
  void backward(const RawArg* args, size_t num_args, void* saved, size_t saved_bytes, void* workspace,
                size_t workspace_bytes, void* stream, bool last_use) const;
  void route(const RawArg* args, size_t num_args, void* workspace, size_t workspace_bytes, void* stream) const;
  // What a call of `pass` reported through its STATUS scalar: a device-side assertion in stream
  // order on a CUDA handle, an error now on a CPU handle.
  void assert_status(Pass pass, const RawTensor* status, void* stream) const;

 private:
  void check_tokens(int64_t num_tokens) const;
  void check_buffer(const char* what, const void* p, size_t have, size_t need) const;

  LayerConfig cfg_;
  std::unique_ptr<Engine> engine_;
  std::string decision_;
};

}  // namespace v0
}  // namespace moeblaze
