/* A program that uses an installed libmoeblaze the way a downstream project does: the public
 * header and the library, found through pkg-config or find_package(MoEBlaze). It checks the
 * run-time ABI against the header's, makes a config, sets a layer's shape and reads it back,
 * and asks for an attribute's metadata. Exits 0 on success. */
#include <moeblaze/moeblaze.h>

#include <stdio.h>

#define CHECK(call)                                                                             \
  do {                                                                                          \
    moeblaze_status_t st_ = (call);                                                             \
    if (st_ != MOEBLAZE_STATUS_SUCCESS) {                                                       \
      fprintf(stderr, "%s: %s (%s)\n", #call, moeblaze_status_name(st_),                        \
              moeblaze_get_last_error_message());                                               \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

int main(void) {
  if (moeblaze_get_abi_version() != MOEBLAZE_ABI_VERSION) {
    fprintf(stderr, "ABI %u at run time, %d in the header\n", moeblaze_get_abi_version(), MOEBLAZE_ABI_VERSION);
    return 1;
  }
  moeblaze_config_t cfg = NULL;
  CHECK(moeblaze_config_create(&cfg));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, 8));
  int64_t experts = 0;
  CHECK(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, &experts));
  moeblaze_attr_info_t info = {0};
  info.struct_size = sizeof info; /* size-versioned: the caller says which fields it has */
  CHECK(moeblaze_attr_query(MOEBLAZE_ATTR_TOP_K, &info));
  CHECK(moeblaze_config_destroy(cfg));
  if (experts != 8) {
    fprintf(stderr, "num_experts read back as %lld\n", (long long)experts);
    return 1;
  }
  printf("consumer: %s\n", moeblaze_get_version_string());
  return 0;
}
