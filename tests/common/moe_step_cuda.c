#include "moe_step_cuda.h"

#include <cuda_runtime.h>
#include <string.h>

enum { GUARD = 256 };

int ms_mirror_create(const ms_problem* p, ms_mirror* m) {
  memset(m, 0, sizeof *m);
  for (int b = 0; b < ms_num_buffers(); ++b) {
    size_t bytes;
    void* host = ms_buffer(p, b, &bytes);
    if (cudaMalloc(&m->dev[m->n], bytes + GUARD) != cudaSuccess) return 1;
    if (cudaMemcpy(m->dev[m->n], host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return 1;
    if (cudaMemset((char*)m->dev[m->n] + bytes, 0xA5, GUARD) != cudaSuccess) return 1;
    m->host[m->n] = host;
    m->bytes[m->n++] = bytes;
  }
  return 0;
}

void ms_mirror_free(ms_mirror* m) {
  for (int b = 0; b < m->n; ++b) cudaFree(m->dev[b]);
  memset(m, 0, sizeof *m);
}

void* ms_mirror_of(const ms_mirror* m, const void* host) {
  for (int b = 0; b < m->n; ++b)
    if (m->host[b] == host) return m->dev[b];
  return NULL;
}

void ms_mirror_args(const ms_mirror* m, moeblaze_arg_t* a, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    void* d = ms_mirror_of(m, a[i].tensor.data);
    if (!d) continue;
    a[i].tensor.data = d;
    a[i].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
    a[i].tensor.device.device_id = 0;
  }
}

int ms_mirror_download(const ms_mirror* m) {
  for (int b = 0; b < m->n; ++b)
    if (cudaMemcpy((void*)m->host[b], m->dev[b], m->bytes[b], cudaMemcpyDeviceToHost) != cudaSuccess) return 1;
  return 0;
}

int ms_mirror_guards_intact(const ms_mirror* m) {
  unsigned char g[GUARD];
  for (int b = 0; b < m->n; ++b) {
    if (cudaMemcpy(g, (char*)m->dev[b] + m->bytes[b], GUARD, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
    for (int i = 0; i < GUARD; ++i)
      if (g[i] != 0xA5) return 0;
  }
  return 1;
}
