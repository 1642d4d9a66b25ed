/* moeblaze_assert_status on a CUDA handle: with STATUS 0 it does nothing (eagerly and replayed
 * from a CUDA graph); with an error it stops the stream with a device-side assertion whose text
 * names the cause, which the CUDA runtime prints and the next synchronisation reports as
 * cudaErrorAssert. That kills the CUDA context, so those cases run in child processes (this
 * program again, with --child PASS) and the parent reads what they printed. Exits 77 (skipped)
 * without a GPU. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static int failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, "\n");                              \
      ++failures;                                         \
    }                                                     \
  } while (0)

static moeblaze_handle_t cuda_handle(void) {
  tu_layer l = tu_layer_default(8, 2, 64, 64, 128, MOEBLAZE_ACTIVATION_SWIGLU);
  moeblaze_handle_t h = NULL;
  if (tu_create_on(&l, MOEBLAZE_DEVICE_CUDA, &h) != MOEBLAZE_STATUS_SUCCESS) {
    fprintf(stderr, "create: %s\n", moeblaze_get_last_error_message());
    exit(1);
  }
  return h;
}

static moeblaze_tensor_t device_scalar(int32_t* p) {
  moeblaze_tensor_t t = tu_tensor(p, tu_i32, 0, NULL);
  t.device.device_type = MOEBLAZE_DEVICE_CUDA;
  return t;
}

/* The child: an error in STATUS, then the assertion and a synchronisation. */
static int child(const char* pass_name) {
  const moeblaze_pass_t pass = strcmp(pass_name, "backward") == 0 ? MOEBLAZE_PASS_BACKWARD : MOEBLAZE_PASS_FORWARD_TRAINING;
  moeblaze_handle_t h = cuda_handle();
  int32_t* d_status = NULL;
  const int32_t one = MOEBLAZE_STATUS_INVALID_ARGUMENT;
  if (cudaMalloc((void**)&d_status, 4) != cudaSuccess || cudaMemcpy(d_status, &one, 4, cudaMemcpyHostToDevice) != cudaSuccess)
    return 1;
  const moeblaze_tensor_t t = device_scalar(d_status);
  const moeblaze_status_t s = moeblaze_assert_status(h, pass, &t, NULL);
  printf("CHILD enqueue: %s\n", moeblaze_status_name(s));
  printf("CHILD sync: %s\n", cudaGetErrorName(cudaDeviceSynchronize()));
  fflush(stdout);
  return 0;
}

static void run_child(const char* self, const char* pass, const char* cause) {
  char cmd[4096], out[16384];
  snprintf(cmd, sizeof cmd, "'%s' --child %s 2>&1", self, pass);
  FILE* f = popen(cmd, "r");
  CHECK(f != NULL, "popen %s", cmd);
  if (!f) return;
  size_t n = fread(out, 1, sizeof out - 1, f);
  out[n] = 0;
  pclose(f);
  printf("--- child (%s) printed:\n%s---\n", pass, out);
  CHECK(strstr(out, "CHILD enqueue: MOEBLAZE_STATUS_SUCCESS") != NULL, "%s: the assertion was not enqueued", pass);
  CHECK(strstr(out, "CHILD sync: cudaErrorAssert") != NULL, "%s: the synchronisation did not report cudaErrorAssert", pass);
  CHECK(strstr(out, cause) != NULL, "%s: the assertion text does not name the cause (%s)", pass, cause);
}

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "--child") == 0) return child(argv[2]);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  moeblaze_handle_t h = cuda_handle();
  int32_t* d_status = NULL;
  CHECK(cudaMalloc((void**)&d_status, 4) == cudaSuccess, "cudaMalloc");
  CHECK(cudaMemset(d_status, 0, 4) == cudaSuccess, "cudaMemset");
  const moeblaze_tensor_t t = device_scalar(d_status);

  /* STATUS 0: nothing happens, eagerly and from a captured graph */
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
  for (int p = 0; p < 4; ++p)
    CHECK(moeblaze_assert_status(h, (moeblaze_pass_t)p, &t, s) == MOEBLAZE_STATUS_SUCCESS, "pass %d: %s", p,
          moeblaze_get_last_error_message());
  CHECK(cudaStreamSynchronize(s) == cudaSuccess, "eager: %s", cudaGetErrorName(cudaGetLastError()));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
  CHECK(moeblaze_assert_status(h, MOEBLAZE_PASS_BACKWARD, &t, s) == MOEBLAZE_STATUS_SUCCESS, "captured: %s",
        moeblaze_get_last_error_message());
  CHECK(cudaStreamEndCapture(s, &graph) == cudaSuccess, "end capture");
  CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
  for (int r = 0; r < 3; ++r) CHECK(cudaGraphLaunch(exec, s) == cudaSuccess, "replay");
  CHECK(cudaStreamSynchronize(s) == cudaSuccess, "replayed");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  /* refused on the host: a host scalar for a CUDA handle, a wrong dtype, an unknown pass */
  int32_t host_status = 0;
  moeblaze_tensor_t bad = tu_tensor(&host_status, tu_i32, 0, NULL);
  CHECK(moeblaze_assert_status(h, MOEBLAZE_PASS_FORWARD_TRAINING, &bad, s) == MOEBLAZE_STATUS_INVALID_ARGUMENT,
        "a host STATUS on a CUDA handle was accepted");
  bad = device_scalar(d_status);
  bad.dtype = tu_f32;
  CHECK(moeblaze_assert_status(h, MOEBLAZE_PASS_FORWARD_TRAINING, &bad, s) == MOEBLAZE_STATUS_INVALID_ARGUMENT,
        "an f32 STATUS was accepted");
  CHECK(moeblaze_assert_status(h, (moeblaze_pass_t)7, &t, s) == MOEBLAZE_STATUS_INVALID_ARGUMENT,
        "pass 7 was accepted");
  CHECK(cudaStreamSynchronize(s) == cudaSuccess, "after refusals");
  cudaStreamDestroy(s);
  cudaFree(d_status);
  moeblaze_destroy(h);

  run_child(argv[0], "forward", "a caller expert id (TOPK_INDICES) outside [0, NUM_EXPERTS) or repeated within a token");
  run_child(argv[0], "backward", "the saved buffer was not written by this layer's forward for these tokens");
  printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
