// Compile-only: the public header stands alone as C++11 (no CUDA include path).
#include "moeblaze/moeblaze.h"

int moeblaze_header_cxx_probe() { return static_cast<int>(MOEBLAZE_ABI_VERSION); }
