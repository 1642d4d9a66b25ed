/* A small reader for the benchmark's config files: finds the "configs" array and reads each
 * object. Two schemas: the paper's (name, d, experts, k, batch, seq; n = 4 d) and the modern
 * one with an explicit expert width (name, T, d, n, E, K). Enough JSON for those files. */
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

static int read_int(const char* obj, const char* end, const char* key, int64_t* out) {
  const char* v = find_key(obj, end, key);
  if (!v) return 0;
  char* stop = NULL;
  *out = strtoll(v, &stop, 10);
  return stop != v;
}

/* One object: 1 when it has every key of either schema. */
static int read_object(const char* p, const char* end, bench_config* c) {
  memset(c, 0, sizeof *c);
  const char* v = find_key(p, end, "name");
  if (v && (v = strchr(v, '"')) != NULL) {
    const char* q = strchr(v + 1, '"');
    size_t len = q ? (size_t)(q - v - 1) : 0;
    if (len >= sizeof c->name) len = sizeof c->name - 1;
    memcpy(c->name, v + 1, len);
  }
  int64_t batch, seq;
  if (read_int(p, end, "T", &c->tokens) && read_int(p, end, "d", &c->d) && read_int(p, end, "n", &c->n) &&
      read_int(p, end, "E", &c->experts) && read_int(p, end, "K", &c->k))
    return 1;
  if (read_int(p, end, "d", &c->d) && read_int(p, end, "experts", &c->experts) && read_int(p, end, "k", &c->k) &&
      read_int(p, end, "batch", &batch) && read_int(p, end, "seq", &seq)) {
    c->tokens = batch * seq;
    c->n = 4 * c->d;
    return 1;
  }
  return 0;
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
      if (read_object(p, end, &out[count])) ++count;
      p = end + 1;
    }
  }
  free(text);
  return count;
}
