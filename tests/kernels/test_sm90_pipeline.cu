// The sm_90a stage pipeline (gemm/sm90/pipeline.cuh) on its own: a producer warpgroup fills a
// ring of S stages and two consumer warpgroups read them, for thousands of fills, with every
// arrival scheme the kernels use:
//   - one elected thread's arrive_expect_tx and a bulk copy (operands by TMA);
//   - that plus every producer thread's cp.async arrival (gathered operands);
//   - consumers released per warp (lane 0) or thread by thread (per_warp = 32);
//   - the ping-pong split: each warpgroup takes every second tile of k-blocks, its MMAs ordered
//     by MmaTurns;
// and ring sizes 2, 3, 4 and 6, so that the phase flips at every position of the stage index.
// Each fill carries a payload that depends on its fill count; the consumers read it twice, a
// pause apart, before they release the stage, so a producer that overwrote a stage too early,
// or a consumer that read it before it was full, shows up as a mismatch. The argument "quick"
// runs 1/16 of the fills (compute-sanitizer's racecheck). Exits 77 (skipped) without an sm_90 GPU.
#include "gemm/sm90/pipeline.cuh"

#include "grouped_gemm_problem.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

namespace sm90 = moeblaze::gemm::sm90;

namespace {


constexpr int kThreads = 384;        // producer warpgroup + two consumer warpgroups
constexpr int kBulkBytes = 2048;     // the elected thread's bulk copy per fill
constexpr int kGatherBytes = 2048;   // 128 producer threads x 16 bytes of cp.async per fill
constexpr int kStageBytes = kBulkBytes + kGatherBytes;
constexpr int kKBlocks = 5;          // fills per tile under ping-pong (coprime with every S)
constexpr int kCtas = 8;

enum class Scheme { kTma, kGathered, kPerThread, kPingPong };

__host__ __device__ uint32_t payload(uint32_t fill, uint32_t word) {
  uint32_t h = fill * 0x9E3779B1u ^ (word + 0x7F4A7C15u) * 0x85EBCA77u;
  h ^= h >> 15;
  return h * 0xC2B2AE3Du;
}

struct Counters {
  unsigned long long mismatches;
  unsigned long long words_checked;
  unsigned int tiles_started[8];  // ping-pong, per CTA: tiles started so far (their order)
  unsigned int order_errors;
};

template <int S, Scheme Sch>
__global__ void __launch_bounds__(kThreads, 1) pipeline_kernel(const uint32_t* src, uint32_t fills, Counters* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + S * kStageBytes);
  using Pipe = sm90::StagePipeline<S>;
  sm90::PipelineArrivals arrivals;
  arrivals.producer = sm90::PipelineArrivals::producer_count(Sch != Scheme::kTma);
  arrivals.consumer_warps = Sch == Scheme::kPingPong ? 4 : 8;
  arrivals.per_warp = Sch == Scheme::kPerThread ? 32 : 1;
  const Pipe pipe = Pipe::init(barriers, arrivals);
  const sm90::MmaTurns turns = sm90::MmaTurns::init(barriers + 2 * S);
  if (threadIdx.x == 0) cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  __syncthreads();
  const uint32_t smem_base = sm90::smem_addr(smem);
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  if (wg == 0) {
    sm90::PipelineState<S> st;
    for (uint32_t f = 0; f < fills; ++f, st.advance()) {
      pipe.acquire(st);
      const uint32_t* fill_src = src + static_cast<size_t>(f) * (kStageBytes / 4);
      const uint32_t stage = smem_base + st.index() * kStageBytes;
      if (t == 0) {
        // Operands by TMA alone: the bulk copy fills the whole stage.
        constexpr uint32_t kBytes = Sch == Scheme::kTma ? kStageBytes : kBulkBytes;
        pipe.arrive_expect_tx(st, kBytes);
        cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem + st.index() * kStageBytes,
                                 fill_src, kBytes, pipe.full_barrier(st));
      }
      if constexpr (Sch != Scheme::kTma) {
        sm90::cp_async_16(stage + kBulkBytes + 16 * t, fill_src + kBulkBytes / 4 + 4 * t, 16u);
        pipe.arrive_cp_async(st);
      }
      if ((f & 63) == 0) __nanosleep(2000);  // now and then a slow producer
    }
    return;
  }
  const int me = wg - 1, ct = threadIdx.x - 128;  // consumer warpgroup and thread (0..255)
  unsigned long long bad = 0, checked = 0;
  // A consumer group of `threads` threads (thread `me_t` of them) reads the stage of fill f.
  // Released per warp, lane 0 reads its warp's share and releases it (the reader is the
  // releaser: racecheck orders reads before the producer's refill only through the reader's
  // own arrival); released per thread, every thread reads its share and releases it.
  auto consume = [&](sm90::PipelineState<S> st, uint32_t f, int threads, int me_t) {
    constexpr bool kPerWarp = Sch != Scheme::kPerThread;
    const int readers = kPerWarp ? threads / 32 : threads, reader = kPerWarp ? me_t / 32 : me_t;
    pipe.wait(st);
    if (!kPerWarp || (me_t & 31) == 0) {
      const uint32_t* stage = reinterpret_cast<const uint32_t*>(smem + st.index() * kStageBytes);
      for (int pass = 0; pass < 2; ++pass) {
        for (int w = reader; w < kStageBytes / 4; w += readers, ++checked) bad += stage[w] != payload(f, w);
        if (pass == 0 && ((f * 7 + reader) & 7) == 0) __nanosleep(1000);  // a slow reader
      }
    }
    __syncwarp();  // the warp stays converged: lanes spinning on the next fill would stall lane 0
    if constexpr (kPerWarp) pipe.release(st);
    else pipe.release_thread(st);
  };
  if constexpr (Sch == Scheme::kPingPong) {
    const uint32_t tiles = fills / kKBlocks;
    uint32_t round = 0;
    for (uint32_t j = me; j < tiles; j += 2, ++round) {
      turns.wait(me, round);
      if (threadIdx.x % 128 == 0 && atomicAdd(&out->tiles_started[blockIdx.x], 1u) != j) atomicAdd(&out->order_errors, 1u);
      sm90::PipelineState<S> st{j * kKBlocks};
      for (int kb = 0; kb < kKBlocks; ++kb, st.advance()) consume(st, st.count, 128, t);
      turns.pass(me);
    }
  } else {
    sm90::PipelineState<S> st;
    for (uint32_t f = 0; f < fills; ++f, st.advance()) consume(st, f, 256, ct);
  }
  atomicAdd(&out->mismatches, bad);
  atomicAdd(&out->words_checked, checked);
}

template <int S, Scheme Sch>
Counters run(uint32_t fills) {
  std::vector<uint32_t> h(static_cast<size_t>(fills) * (kStageBytes / 4));
  for (uint32_t f = 0; f < fills; ++f)
    for (uint32_t w = 0; w < kStageBytes / 4; ++w) h[static_cast<size_t>(f) * (kStageBytes / 4) + w] = payload(f, w);
  uint32_t* src = nullptr;
  Counters* out = nullptr;
  GGP_CK(cudaMalloc(&src, h.size() * 4));
  GGP_CK(cudaMalloc(&out, sizeof(Counters)));
  GGP_CK(cudaMemcpy(src, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  GGP_CK(cudaMemset(out, 0, sizeof(Counters)));
  const int smem = S * kStageBytes + (2 * S + 2) * 8;
  auto* kernel = pipeline_kernel<S, Sch>;
  GGP_CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // Several CTAs at once, each its own ring: the SMs interleave them differently every run.
  kernel<<<kCtas, kThreads, smem>>>(src, fills, out);
  GGP_CK(cudaGetLastError());
  GGP_CK(cudaDeviceSynchronize());
  Counters c;
  GGP_CK(cudaMemcpy(&c, out, sizeof(c), cudaMemcpyDeviceToHost));
  GGP_CK(cudaFree(src));
  GGP_CK(cudaFree(out));
  return c;
}

// Every word of every fill read twice by exactly the expected readers, all equal to the payload.
uint32_t g_fill_divisor = 1;

template <int S, Scheme Sch>
void check(uint32_t fills) {
  if (fills > 100) fills = fills / g_fill_divisor | 1;
  if (Sch == Scheme::kPingPong) fills = fills / kKBlocks * kKBlocks;
  const Counters c = run<S, Sch>(fills);
  const unsigned long long per_cta = (Sch == Scheme::kPingPong ? fills / kKBlocks * kKBlocks : fills) *
                                     static_cast<unsigned long long>(2 * kStageBytes / 4);
  std::printf("stages %d scheme %d: %u fills, %llu words checked, %llu mismatches, %u order errors\n", S,
              static_cast<int>(Sch), fills, c.words_checked, c.mismatches, c.order_errors);
  assert_int_equal(c.words_checked, kCtas * per_cta);
  assert_int_equal(c.mismatches, 0);
  assert_int_equal(c.order_errors, 0);
  if (Sch == Scheme::kPingPong)
    for (int b = 0; b < kCtas; ++b) assert_int_equal(c.tiles_started[b], fills / kKBlocks);
}

void tma_arrivals(void**) {
  check<2, Scheme::kTma>(3001);
  check<3, Scheme::kTma>(3001);
  check<4, Scheme::kTma>(3001);
  check<6, Scheme::kTma>(3001);
}

void gathered_arrivals(void**) {
  check<2, Scheme::kGathered>(3001);
  check<3, Scheme::kGathered>(3001);
  check<4, Scheme::kGathered>(3001);
  check<6, Scheme::kGathered>(3001);
}

void release_per_thread(void**) {
  check<3, Scheme::kPerThread>(2003);
  check<4, Scheme::kPerThread>(2003);
}

void ping_pong_turns(void**) {
  check<4, Scheme::kPingPong>(kKBlocks * 601);
  check<6, Scheme::kPingPong>(kKBlocks * 601);
  check<3, Scheme::kPingPong>(kKBlocks * 2);  // one tile each
  check<3, Scheme::kPingPong>(kKBlocks * 1);  // the second warpgroup has none
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "quick") == 0) g_fill_divisor = 16;
  ggp::skip_without_sm90();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(tma_arrivals),
      cmocka_unit_test(gathered_arrivals),
      cmocka_unit_test(release_per_thread),
      cmocka_unit_test(ping_pong_turns),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
