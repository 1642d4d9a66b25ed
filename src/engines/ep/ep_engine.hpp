// The expert-parallel layer (docs/ep.md): one MoE layer over the P ranks of an NCCL
// communicator, each rank holding E / P experts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/config.hpp"
#include "core/engine.hpp"

namespace moeblaze {
inline namespace v0 {

struct EpOptions {
  void* nccl_comm = nullptr;     // ncclComm_t, borrowed; or null, and then:
  const void* unique_id = nullptr;  // an ncclUniqueId: create makes (and the layer owns) the communicator
  size_t unique_id_bytes = 0;
  int32_t ranks = 0, rank = -1;     //   of `ranks` ranks, this one being `rank`
  void* stream = nullptr;        // create's stream (the configuration check runs on it)
};

// Collective over the communicator: every rank calls it with the same configuration (its EP_*
// attributes included). Sets cfg.ep_ranks and cfg.ep_rank_of and resolves cfg.engine to the
// engine of the local experts.
std::unique_ptr<Engine> make_ep_engine(LayerConfig& cfg, const EpOptions& opt, std::string* decision);

// The symmetric bytes one rank allocates for a layer of cfg over `ranks` ranks (shape-only).
size_t ep_symmetric_bytes(const LayerConfig& cfg, int32_t ranks);

}  // namespace v0
}  // namespace moeblaze
