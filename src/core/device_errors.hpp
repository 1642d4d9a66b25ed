// What a sync-free call reports through its STATUS scalar, in words: the text of the device-side
// assertion that moeblaze_assert_status raises and of the CPU handle's error. String literals,
// so a kernel can pass them to the assertion handler as they are.
#pragma once

#define MOEBLAZE_DEVICE_ERROR_FORWARD                                                              \
  "moeblaze forward reported INVALID_ARGUMENT through STATUS: a caller expert id (TOPK_INDICES) " \
  "outside [0, NUM_EXPERTS) or repeated within a token, or SEQUENCE_LENGTHS with a length "       \
  "outside [1, tokens] or not summing to the tokens"
#define MOEBLAZE_DEVICE_ERROR_BACKWARD                                                             \
  "moeblaze backward reported INVALID_ARGUMENT through STATUS: the saved buffer was not written " \
  "by this layer's forward for these tokens, or SEQUENCE_LENGTHS with a length outside "         \
  "[1, tokens] or not summing to the tokens"
#define MOEBLAZE_DEVICE_ERROR_ROUTE                                                                \
  "moeblaze route reported INVALID_ARGUMENT through STATUS: SEQUENCE_LENGTHS with a length "      \
  "outside [1, tokens] or not summing to the tokens"
#define MOEBLAZE_DEVICE_ERROR_EP_RECV_BOUND                                                          \
  "moeblaze expert-parallel step reported INSUFFICIENT_WORKSPACE through STATUS: some rank would " \
  "receive more rows than EP_MAX_RECV_TOKENS; nothing was sent and every output is NaN"
#define MOEBLAZE_DEVICE_ERROR_EP_ROWS_LATE                                                            \
  "moeblaze expert-parallel step reported INTERNAL_ERROR through STATUS: rows from another rank "  \
  "did not arrive within 20 s (a rank stopped, or called a different sequence of steps); every "   \
  "output is NaN"
