/* The frozen structs: DLPack-identical layouts and 32-bit enums, checked at compile time
 * (the binding tests assert the same numbers). Running it prints the layout. */
#include <stddef.h>
#include <stdio.h>

#include "moeblaze/moeblaze.h"

_Static_assert(sizeof(moeblaze_device_t) == 8, "moeblaze_device_t == DLDevice");
_Static_assert(sizeof(moeblaze_dtype_t) == 4, "moeblaze_dtype_t == DLDataType");
_Static_assert(offsetof(moeblaze_dtype_t, bits) == 1 && offsetof(moeblaze_dtype_t, lanes) == 2, "DLDataType fields");
_Static_assert(sizeof(moeblaze_tensor_t) == 48, "moeblaze_tensor_t == DLTensor (48 bytes)");
_Static_assert(offsetof(moeblaze_tensor_t, data) == 0, "DLTensor.data");
_Static_assert(offsetof(moeblaze_tensor_t, device) == 8, "DLTensor.device");
_Static_assert(offsetof(moeblaze_tensor_t, ndim) == 16, "DLTensor.ndim");
_Static_assert(offsetof(moeblaze_tensor_t, dtype) == 20, "DLTensor.dtype");
_Static_assert(offsetof(moeblaze_tensor_t, shape) == 24, "DLTensor.shape");
_Static_assert(offsetof(moeblaze_tensor_t, strides) == 32, "DLTensor.strides");
_Static_assert(offsetof(moeblaze_tensor_t, byte_offset) == 40, "DLTensor.byte_offset");
_Static_assert(sizeof(moeblaze_arg_t) == 56, "moeblaze_arg_t");
_Static_assert(offsetof(moeblaze_arg_t, flags) == 4 && offsetof(moeblaze_arg_t, tensor) == 8, "moeblaze_arg_t fields");
_Static_assert(offsetof(moeblaze_attr_info_t, struct_size) == 0, "struct_size comes first");
_Static_assert(sizeof(moeblaze_status_t) == 4 && sizeof(moeblaze_attr_t) == 4 && sizeof(moeblaze_arg_kind_t) == 4 &&
                   sizeof(moeblaze_pass_t) == 4 && sizeof(moeblaze_activation_t) == 4 && sizeof(moeblaze_engine_t) == 4,
               "enums are 32-bit");
/* Frozen values (docs/abi-policy.md): a renumbering fails here before it reaches abidiff. */
_Static_assert(MOEBLAZE_STATUS_INTERNAL_ERROR == 12 && MOEBLAZE_ATTR_NUM_THREADS == 18 && MOEBLAZE_ATTR_WINDOW_TOKENS == 19 && MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS == 102 &&
                   MOEBLAZE_ARG_Z_LOSS == 35 && MOEBLAZE_ATTR_AUX_LOSS_FORM == 28 && MOEBLAZE_ATTR_WINDOW_BYTES == 29 &&
                   MOEBLAZE_PASS_ROUTE == 3 && MOEBLAZE_SAVE_ALL == 2 && MOEBLAZE_ACTIVATION_GEGLU == 4,
               "frozen enumerator values");

int main(void) {
  printf("moeblaze_tensor_t %zu bytes, moeblaze_arg_t %zu bytes, moeblaze_attr_info_t %zu bytes\n", sizeof(moeblaze_tensor_t),
         sizeof(moeblaze_arg_t), sizeof(moeblaze_attr_info_t));
  return 0;
}
