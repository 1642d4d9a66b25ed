/* Compile-only: the public header stands alone as strict C99 (no CUDA include path). */
#include "moeblaze/moeblaze.h"

int moeblaze_header_c99_probe(void) { return (int)MOEBLAZE_VERSION_MAJOR; }
