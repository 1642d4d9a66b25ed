/* A small reader for ../shared/bench/paper-configs.json: finds the "configs" array and reads
 * each object's name, d, experts, k, batch and seq. Enough JSON for that file, no more. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static const char* find_key(const char* obj, const char* end, const char* key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", key);
  const char* p = strstr(obj, pat);
  if (!p || p >= end) return NULL;
  p = strchr(p + strlen(pat), ':');
  return (p && p < end) ? p + 1 : NULL;
}

int bench_read_configs(const char* path, bench_config* out, int max) {
  FILE* f = fopen(path, "rb");
  if (!f) return -1;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* text = malloc((size_t)n + 1);
  if (!text || fread(text, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(text); return -1; }
  text[n] = '\0';
  fclose(f);
  int count = -1;
  const char* p = strstr(text, "\"configs\"");
  if (p && (p = strchr(p, '[')) != NULL) {
    count = 0;
    const char* array_end = strchr(p, ']');
    while (count < max && (p = strchr(p, '{')) != NULL && p < array_end) {
      const char* end = strchr(p, '}');
      if (!end) break;
      bench_config* c = &out[count];
      memset(c, 0, sizeof *c);
      const char* v = find_key(p, end, "name");
      if (v && (v = strchr(v, '"')) != NULL) {
        const char* q = strchr(v + 1, '"');
        size_t len = q ? (size_t)(q - v - 1) : 0;
        if (len >= sizeof c->name) len = sizeof c->name - 1;
        memcpy(c->name, v + 1, len);
      }
      const char* keys[5] = {"d", "experts", "k", "batch", "seq"};
      int64_t* dst[5] = {&c->d, &c->experts, &c->k, &c->batch, &c->seq};
      int ok = 1;
      for (int i = 0; i < 5; ++i) {
        v = find_key(p, end, keys[i]);
        if (!v) { ok = 0; break; }
        *dst[i] = strtoll(v, NULL, 10);
      }
      if (ok) ++count;
      p = end + 1;
    }
  }
  free(text);
  return count;
}
