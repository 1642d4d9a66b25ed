//! Raw FFI declarations of libmoeblaze, hand-written from `include/moeblaze/moeblaze.h`.
//!
//! * Every C enum is a `pub type X = i32` plus `pub const` values, never a Rust `enum`: the
//!   library may return a value this crate does not know, and an unknown value in a Rust enum
//!   is undefined behaviour.
//! * The four frozen structs (`moeblaze_device_t`, `moeblaze_dtype_t`, `moeblaze_tensor_t` ==
//!   DLPack's `DLTensor`, `moeblaze_arg_t`) and `moeblaze_attr_info_t` are `#[repr(C)]` mirrors
//!   whose sizes and field offsets are tested.
//! * Opaque handles follow the Nomicon pattern (zero-sized, `!Send`, `!Sync`, `!Unpin`).
//!
//! See the `moeblaze` crate for a safe wrapper.
#![allow(non_camel_case_types, non_upper_case_globals)]
#![no_std]

use core::ffi::{c_char, c_void};
use core::marker::{PhantomData, PhantomPinned};

// ---- version -------------------------------------------------------------------------------
pub const MOEBLAZE_VERSION_MAJOR: u32 = 0;
pub const MOEBLAZE_VERSION_MINOR: u32 = 2;
pub const MOEBLAZE_VERSION_PATCH: u32 = 0;
/// `MOEBLAZE_VERSION_ENCODE(major, minor, patch)`.
pub const fn moeblaze_version_encode(major: u32, minor: u32, patch: u32) -> u32 {
    major * 1_000_000 + minor * 1_000 + patch
}
pub const MOEBLAZE_VERSION: u32 = moeblaze_version_encode(
    MOEBLAZE_VERSION_MAJOR,
    MOEBLAZE_VERSION_MINOR,
    MOEBLAZE_VERSION_PATCH,
);
/// The ABI this crate was written for; equals the SONAME suffix (libmoeblaze.so.0).
pub const MOEBLAZE_ABI_VERSION: u32 = 0;

// ---- status --------------------------------------------------------------------------------
pub type moeblaze_status_t = i32;
pub const MOEBLAZE_STATUS_SUCCESS: moeblaze_status_t = 0;
pub const MOEBLAZE_STATUS_INVALID_ARGUMENT: moeblaze_status_t = 1;
pub const MOEBLAZE_STATUS_NOT_SUPPORTED: moeblaze_status_t = 2;
pub const MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE: moeblaze_status_t = 3;
pub const MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY: moeblaze_status_t = 4;
pub const MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY: moeblaze_status_t = 5;
pub const MOEBLAZE_STATUS_CUDA_ERROR: moeblaze_status_t = 6;
pub const MOEBLAZE_STATUS_CUBLAS_ERROR: moeblaze_status_t = 7;
pub const MOEBLAZE_STATUS_ARCH_MISMATCH: moeblaze_status_t = 8;
pub const MOEBLAZE_STATUS_VERSION_MISMATCH: moeblaze_status_t = 9;
pub const MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE: moeblaze_status_t = 10;
pub const MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH: moeblaze_status_t = 11;
pub const MOEBLAZE_STATUS_INTERNAL_ERROR: moeblaze_status_t = 12;

// ---- logging -------------------------------------------------------------------------------
pub type moeblaze_log_level_t = i32;
pub const MOEBLAZE_LOG_ERROR: moeblaze_log_level_t = 1;
pub const MOEBLAZE_LOG_WARN: moeblaze_log_level_t = 2;
pub const MOEBLAZE_LOG_INFO: moeblaze_log_level_t = 3;
pub const MOEBLAZE_LOG_DEBUG: moeblaze_log_level_t = 4;

/// `void (*)(void* user_data, int32_t level, const char* func, const char* msg)`; may be NULL.
pub type moeblaze_log_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        level: i32,
        func: *const c_char,
        msg: *const c_char,
    ),
>;

// ---- devices, dtypes, tensors --------------------------------------------------------------
/// Opaque CUDA stream (`cudaStream_t` / `CUstream`).
#[repr(C)]
pub struct CUstream_st {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}
/// A CUDA stream; NULL is the legacy default stream. Ignored by CPU handles.
pub type moeblaze_stream_t = *mut CUstream_st;

pub type moeblaze_device_type_t = i32;
pub const MOEBLAZE_DEVICE_CPU: moeblaze_device_type_t = 1;
pub const MOEBLAZE_DEVICE_CUDA: moeblaze_device_type_t = 2;

/// `moeblaze_device_t` == DLPack `DLDevice`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct moeblaze_device_t {
    pub device_type: i32,
    pub device_id: i32,
}

/// `moeblaze_dtype_t` == DLPack `DLDataType`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct moeblaze_dtype_t {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

pub type moeblaze_dtype_code_t = i32;
pub const MOEBLAZE_DTYPE_CODE_INT: moeblaze_dtype_code_t = 0;
pub const MOEBLAZE_DTYPE_CODE_UINT: moeblaze_dtype_code_t = 1;
pub const MOEBLAZE_DTYPE_CODE_FLOAT: moeblaze_dtype_code_t = 2;
pub const MOEBLAZE_DTYPE_CODE_BFLOAT: moeblaze_dtype_code_t = 4;

pub const MOEBLAZE_DTYPE_F32: moeblaze_dtype_t = moeblaze_dtype_t {
    code: 2,
    bits: 32,
    lanes: 1,
};
pub const MOEBLAZE_DTYPE_F16: moeblaze_dtype_t = moeblaze_dtype_t {
    code: 2,
    bits: 16,
    lanes: 1,
};
pub const MOEBLAZE_DTYPE_BF16: moeblaze_dtype_t = moeblaze_dtype_t {
    code: 4,
    bits: 16,
    lanes: 1,
};
pub const MOEBLAZE_DTYPE_I32: moeblaze_dtype_t = moeblaze_dtype_t {
    code: 0,
    bits: 32,
    lanes: 1,
};
pub const MOEBLAZE_DTYPE_I64: moeblaze_dtype_t = moeblaze_dtype_t {
    code: 0,
    bits: 64,
    lanes: 1,
};

/// `moeblaze_tensor_t`, field-for-field DLPack's `DLTensor` (48 bytes).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct moeblaze_tensor_t {
    pub data: *mut c_void,
    pub device: moeblaze_device_t,
    pub ndim: i32,
    pub dtype: moeblaze_dtype_t,
    pub shape: *const i64,
    /// Strides in elements, or NULL for contiguous row-major.
    pub strides: *const i64,
    pub byte_offset: u64,
}

// ---- config --------------------------------------------------------------------------------
/// Opaque configuration object.
#[repr(C)]
pub struct moeblaze_config_s {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}
pub type moeblaze_config_t = *mut moeblaze_config_s;

pub type moeblaze_activation_t = i32;
pub const MOEBLAZE_ACTIVATION_RELU: moeblaze_activation_t = 0;
pub const MOEBLAZE_ACTIVATION_GELU: moeblaze_activation_t = 1;
pub const MOEBLAZE_ACTIVATION_SILU: moeblaze_activation_t = 2;
pub const MOEBLAZE_ACTIVATION_SWIGLU: moeblaze_activation_t = 3;
pub const MOEBLAZE_ACTIVATION_GEGLU: moeblaze_activation_t = 4;

pub type moeblaze_score_fn_t = i32;
pub const MOEBLAZE_SCORE_SOFTMAX: moeblaze_score_fn_t = 0;
pub const MOEBLAZE_SCORE_SIGMOID: moeblaze_score_fn_t = 1;

pub type moeblaze_aux_loss_form_t = i32;
pub const MOEBLAZE_AUX_LOSS_SWITCH: moeblaze_aux_loss_form_t = 0;
pub const MOEBLAZE_AUX_LOSS_HUGGING_FACE: moeblaze_aux_loss_form_t = 1;

pub type moeblaze_save_policy_t = i32;
pub const MOEBLAZE_SAVE_PREACT: moeblaze_save_policy_t = 0;
pub const MOEBLAZE_SAVE_RECOMPUTE_UP: moeblaze_save_policy_t = 1;
pub const MOEBLAZE_SAVE_ALL: moeblaze_save_policy_t = 2;

pub type moeblaze_engine_t = i32;
pub const MOEBLAZE_ENGINE_AUTO: moeblaze_engine_t = 0;
pub const MOEBLAZE_ENGINE_CPU: moeblaze_engine_t = 1;
pub const MOEBLAZE_ENGINE_CUDA_CUBLASLT: moeblaze_engine_t = 2;
pub const MOEBLAZE_ENGINE_CUDA_FUSED: moeblaze_engine_t = 3;

pub type moeblaze_value_type_t = i32;
pub const MOEBLAZE_VALUE_I64: moeblaze_value_type_t = 0;
pub const MOEBLAZE_VALUE_F64: moeblaze_value_type_t = 1;
pub const MOEBLAZE_VALUE_DTYPE: moeblaze_value_type_t = 2;

pub type moeblaze_attr_t = i32;
pub const MOEBLAZE_ATTR_NUM_EXPERTS: moeblaze_attr_t = 0;
pub const MOEBLAZE_ATTR_TOP_K: moeblaze_attr_t = 1;
pub const MOEBLAZE_ATTR_HIDDEN_SIZE: moeblaze_attr_t = 2;
pub const MOEBLAZE_ATTR_FFN_HIDDEN_SIZE: moeblaze_attr_t = 3;
pub const MOEBLAZE_ATTR_MAX_TOKENS: moeblaze_attr_t = 4;
pub const MOEBLAZE_ATTR_ACTIVATION: moeblaze_attr_t = 5;
pub const MOEBLAZE_ATTR_SCORE_FUNCTION: moeblaze_attr_t = 6;
pub const MOEBLAZE_ATTR_NORMALIZE_TOPK: moeblaze_attr_t = 7;
pub const MOEBLAZE_ATTR_AUX_LOSS_COEFF: moeblaze_attr_t = 8;
pub const MOEBLAZE_ATTR_Z_LOSS_COEFF: moeblaze_attr_t = 9;
pub const MOEBLAZE_ATTR_ACTIVATION_DTYPE: moeblaze_attr_t = 10;
pub const MOEBLAZE_ATTR_WEIGHT_DTYPE: moeblaze_attr_t = 11;
pub const MOEBLAZE_ATTR_ACCUM_DTYPE: moeblaze_attr_t = 12;
pub const MOEBLAZE_ATTR_SAVE_POLICY: moeblaze_attr_t = 13;
pub const MOEBLAZE_ATTR_DETERMINISTIC: moeblaze_attr_t = 14;
pub const MOEBLAZE_ATTR_DEVICE_TYPE: moeblaze_attr_t = 15;
pub const MOEBLAZE_ATTR_DEVICE_ID: moeblaze_attr_t = 16;
pub const MOEBLAZE_ATTR_ENGINE: moeblaze_attr_t = 17;
pub const MOEBLAZE_ATTR_NUM_THREADS: moeblaze_attr_t = 18;
pub const MOEBLAZE_ATTR_WINDOW_TOKENS: moeblaze_attr_t = 19;
pub const MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS: moeblaze_attr_t = 20;
pub const MOEBLAZE_ATTR_EP_TRANSPORT: moeblaze_attr_t = 21;
pub const MOEBLAZE_ATTR_EP_COMM_SMS: moeblaze_attr_t = 22;
pub const MOEBLAZE_ATTR_EP_SIZE: moeblaze_attr_t = 23;
pub const MOEBLAZE_ATTR_EP_RANK: moeblaze_attr_t = 24;
pub const MOEBLAZE_ATTR_NUM_EXPERT_GROUPS: moeblaze_attr_t = 25;
pub const MOEBLAZE_ATTR_TOPK_GROUPS: moeblaze_attr_t = 26;
pub const MOEBLAZE_ATTR_ROUTE_SCALE: moeblaze_attr_t = 27;
pub const MOEBLAZE_ATTR_AUX_LOSS_FORM: moeblaze_attr_t = 28;
/// Attributes known to this header are 0..MOEBLAZE_ATTR_COUNT-1 (the library may know more).
pub const MOEBLAZE_ATTR_COUNT: i32 = 29;

/// `moeblaze_attr_info_t`. Set `struct_size` before calling `moeblaze_attr_query`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct moeblaze_attr_info_t {
    pub struct_size: usize,
    /// Static lower-case name such as "top_k".
    pub name: *const c_char,
    pub value_type: i32,
    pub required: i32,
    pub min_i64: i64,
    pub max_i64: i64,
    pub default_i64: i64,
    pub default_f64: f64,
    pub since_version: u32,
}

// ---- handles, sizes, execution -------------------------------------------------------------
/// Opaque handle.
#[repr(C)]
pub struct moeblaze_handle_s {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}
pub type moeblaze_handle_t = *mut moeblaze_handle_s;

/// Required alignment, in bytes, of workspace and saved buffers.
pub const MOEBLAZE_BUFFER_ALIGNMENT: usize = 256;

pub type moeblaze_pass_t = i32;
pub const MOEBLAZE_PASS_FORWARD_TRAINING: moeblaze_pass_t = 0;
pub const MOEBLAZE_PASS_FORWARD_INFERENCE: moeblaze_pass_t = 1;
pub const MOEBLAZE_PASS_BACKWARD: moeblaze_pass_t = 2;
pub const MOEBLAZE_PASS_ROUTE: moeblaze_pass_t = 3;
pub const MOEBLAZE_PASS_BACKWARD_LAST_USE: moeblaze_pass_t = 4;

pub type moeblaze_arg_kind_t = i32;
pub const MOEBLAZE_ARG_INPUT: moeblaze_arg_kind_t = 1;
pub const MOEBLAZE_ARG_ROUTER_WEIGHT: moeblaze_arg_kind_t = 2;
pub const MOEBLAZE_ARG_ROUTER_LOGITS: moeblaze_arg_kind_t = 3;
pub const MOEBLAZE_ARG_EXPERT_BIAS: moeblaze_arg_kind_t = 4;
pub const MOEBLAZE_ARG_W_GATE_UP: moeblaze_arg_kind_t = 5;
pub const MOEBLAZE_ARG_W_DOWN: moeblaze_arg_kind_t = 6;
pub const MOEBLAZE_ARG_TOPK_INDICES: moeblaze_arg_kind_t = 7;
pub const MOEBLAZE_ARG_TOPK_WEIGHTS: moeblaze_arg_kind_t = 8;
pub const MOEBLAZE_ARG_SEQUENCE_LENGTHS: moeblaze_arg_kind_t = 9;
pub const MOEBLAZE_ARG_TOKEN_MASK: moeblaze_arg_kind_t = 10;
pub const MOEBLAZE_ARG_OUTPUT: moeblaze_arg_kind_t = 32;
pub const MOEBLAZE_ARG_AUX_LOSS: moeblaze_arg_kind_t = 33;
pub const MOEBLAZE_ARG_TOKENS_PER_EXPERT: moeblaze_arg_kind_t = 34;
pub const MOEBLAZE_ARG_Z_LOSS: moeblaze_arg_kind_t = 35;
/// Optional I32 scalar output: the call's device-side status (0 = success). Since 0.2.
pub const MOEBLAZE_ARG_STATUS: moeblaze_arg_kind_t = 36;
pub const MOEBLAZE_ARG_GRAD_OUTPUT: moeblaze_arg_kind_t = 64;
pub const MOEBLAZE_ARG_GRAD_AUX_LOSS: moeblaze_arg_kind_t = 65;
pub const MOEBLAZE_ARG_GRAD_Z_LOSS: moeblaze_arg_kind_t = 66;
pub const MOEBLAZE_ARG_GRAD_INPUT: moeblaze_arg_kind_t = 96;
pub const MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT: moeblaze_arg_kind_t = 97;
pub const MOEBLAZE_ARG_GRAD_ROUTER_LOGITS: moeblaze_arg_kind_t = 98;
pub const MOEBLAZE_ARG_GRAD_W_GATE_UP: moeblaze_arg_kind_t = 100;
pub const MOEBLAZE_ARG_GRAD_W_DOWN: moeblaze_arg_kind_t = 101;
pub const MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS: moeblaze_arg_kind_t = 102;

/// Flag on a gradient output: add the result to the tensor instead of overwriting it.
pub const MOEBLAZE_ARG_FLAG_ACCUMULATE: u32 = 0x1;

/// `moeblaze_arg_t` (56 bytes).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct moeblaze_arg_t {
    pub kind: i32,
    pub flags: u32,
    pub tensor: moeblaze_tensor_t,
}

extern "C" {
    pub fn moeblaze_get_version() -> u32;
    pub fn moeblaze_get_version_string() -> *const c_char;
    pub fn moeblaze_get_abi_version() -> u32;
    pub fn moeblaze_get_build_info() -> *const c_char;

    pub fn moeblaze_status_name(status: moeblaze_status_t) -> *const c_char;
    pub fn moeblaze_status_string(status: moeblaze_status_t) -> *const c_char;
    pub fn moeblaze_get_last_error_message() -> *const c_char;
    pub fn moeblaze_set_log_callback(
        fn_: moeblaze_log_fn,
        user_data: *mut c_void,
        min_level: i32,
    ) -> moeblaze_status_t;

    pub fn moeblaze_config_create(out: *mut moeblaze_config_t) -> moeblaze_status_t;
    pub fn moeblaze_config_destroy(cfg: moeblaze_config_t) -> moeblaze_status_t;
    pub fn moeblaze_config_set_i64(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        value: i64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_config_set_f64(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        value: f64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_config_set_dtype(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        value: moeblaze_dtype_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_config_get_i64(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        out: *mut i64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_config_get_f64(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        out: *mut f64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_config_get_dtype(
        cfg: moeblaze_config_t,
        attr: moeblaze_attr_t,
        out: *mut moeblaze_dtype_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_attr_query(
        attr: moeblaze_attr_t,
        info: *mut moeblaze_attr_info_t,
    ) -> moeblaze_status_t;

    pub fn moeblaze_get_device_count(device_type: i32, count: *mut i32) -> moeblaze_status_t;
    pub fn moeblaze_create(
        out: *mut moeblaze_handle_t,
        cfg: moeblaze_config_t,
    ) -> moeblaze_status_t;
    /// Collective over the ranks of `nccl_comm` (an `ncclComm_t`, borrowed); `stream` is a
    /// `cudaStream_t`.
    pub fn moeblaze_create_ep(
        out: *mut moeblaze_handle_t,
        cfg: moeblaze_config_t,
        nccl_comm: *mut c_void,
        stream: *mut c_void,
    ) -> moeblaze_status_t;
    /// Collective over `nranks` ranks sharing one `ncclUniqueId` (`unique_id_bytes` = 128).
    pub fn moeblaze_create_ep_from_unique_id(
        out: *mut moeblaze_handle_t,
        cfg: moeblaze_config_t,
        unique_id: *const c_void,
        unique_id_bytes: usize,
        nranks: i32,
        rank: i32,
        stream: *mut c_void,
    ) -> moeblaze_status_t;
    pub fn moeblaze_get_symmetric_size(
        cfg: moeblaze_config_t,
        ep_size: i32,
        bytes: *mut usize,
    ) -> moeblaze_status_t;
    pub fn moeblaze_destroy(handle: moeblaze_handle_t) -> moeblaze_status_t;
    pub fn moeblaze_handle_get_i64(
        handle: moeblaze_handle_t,
        attr: moeblaze_attr_t,
        out: *mut i64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_handle_get_f64(
        handle: moeblaze_handle_t,
        attr: moeblaze_attr_t,
        out: *mut f64,
    ) -> moeblaze_status_t;
    pub fn moeblaze_handle_get_dtype(
        handle: moeblaze_handle_t,
        attr: moeblaze_attr_t,
        out: *mut moeblaze_dtype_t,
    ) -> moeblaze_status_t;

    pub fn moeblaze_get_workspace_size(
        handle: moeblaze_handle_t,
        pass: moeblaze_pass_t,
        num_tokens: i64,
        bytes: *mut usize,
    ) -> moeblaze_status_t;
    pub fn moeblaze_get_saved_size(
        handle: moeblaze_handle_t,
        num_tokens: i64,
        bytes: *mut usize,
    ) -> moeblaze_status_t;

    pub fn moeblaze_check_args(
        handle: moeblaze_handle_t,
        pass: moeblaze_pass_t,
        args: *const moeblaze_arg_t,
        num_args: usize,
    ) -> moeblaze_status_t;
    pub fn moeblaze_forward(
        handle: moeblaze_handle_t,
        pass: moeblaze_pass_t,
        args: *const moeblaze_arg_t,
        num_args: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        saved: *mut c_void,
        saved_bytes: usize,
        stream: moeblaze_stream_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_backward(
        handle: moeblaze_handle_t,
        args: *const moeblaze_arg_t,
        num_args: usize,
        saved: *const c_void,
        saved_bytes: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: moeblaze_stream_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_backward_last_use(
        handle: moeblaze_handle_t,
        args: *const moeblaze_arg_t,
        num_args: usize,
        saved: *mut c_void,
        saved_bytes: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: moeblaze_stream_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_route(
        handle: moeblaze_handle_t,
        args: *const moeblaze_arg_t,
        num_args: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: moeblaze_stream_t,
    ) -> moeblaze_status_t;
    pub fn moeblaze_assert_status(
        handle: moeblaze_handle_t,
        pass: moeblaze_pass_t,
        status: *const moeblaze_tensor_t,
        stream: moeblaze_stream_t,
    ) -> moeblaze_status_t;
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use core::mem::{align_of, offset_of, size_of};
    use std::string::{String, ToString};
    use std::vec::Vec;

    #[test]
    fn struct_layouts() {
        assert_eq!(size_of::<moeblaze_device_t>(), 8);
        assert_eq!(align_of::<moeblaze_device_t>(), 4);
        assert_eq!(size_of::<moeblaze_dtype_t>(), 4);
        assert_eq!(align_of::<moeblaze_dtype_t>(), 2);
        assert_eq!(size_of::<moeblaze_tensor_t>(), 48);
        assert_eq!(align_of::<moeblaze_tensor_t>(), 8);
        assert_eq!(offset_of!(moeblaze_tensor_t, device), 8);
        assert_eq!(offset_of!(moeblaze_tensor_t, ndim), 16);
        assert_eq!(offset_of!(moeblaze_tensor_t, dtype), 20);
        assert_eq!(offset_of!(moeblaze_tensor_t, shape), 24);
        assert_eq!(offset_of!(moeblaze_tensor_t, strides), 32);
        assert_eq!(offset_of!(moeblaze_tensor_t, byte_offset), 40);
        assert_eq!(size_of::<moeblaze_arg_t>(), 56);
        assert_eq!(align_of::<moeblaze_arg_t>(), 8);
        assert_eq!(offset_of!(moeblaze_arg_t, flags), 4);
        assert_eq!(offset_of!(moeblaze_arg_t, tensor), 8);
        assert_eq!(size_of::<moeblaze_attr_info_t>(), 64);
        assert_eq!(offset_of!(moeblaze_attr_info_t, since_version), 56);
        assert_eq!(size_of::<moeblaze_handle_s>(), 0);
    }

    #[test]
    fn abi_version_matches() {
        // Also proves that the library links and loads (rpath from build.rs).
        assert_eq!(unsafe { moeblaze_get_abi_version() }, MOEBLAZE_ABI_VERSION);
        assert_eq!(unsafe { moeblaze_get_version() }, MOEBLAZE_VERSION);
    }

    /// Every function of the extern block, as a pointer: fails to link if one is missing.
    #[test]
    fn every_symbol_links() {
        let ptrs: [usize; 34] = [
            moeblaze_get_version as *const () as usize,
            moeblaze_get_version_string as *const () as usize,
            moeblaze_get_abi_version as *const () as usize,
            moeblaze_get_build_info as *const () as usize,
            moeblaze_status_name as *const () as usize,
            moeblaze_status_string as *const () as usize,
            moeblaze_get_last_error_message as *const () as usize,
            moeblaze_set_log_callback as *const () as usize,
            moeblaze_config_create as *const () as usize,
            moeblaze_config_destroy as *const () as usize,
            moeblaze_config_set_i64 as *const () as usize,
            moeblaze_config_set_f64 as *const () as usize,
            moeblaze_config_set_dtype as *const () as usize,
            moeblaze_config_get_i64 as *const () as usize,
            moeblaze_config_get_f64 as *const () as usize,
            moeblaze_config_get_dtype as *const () as usize,
            moeblaze_attr_query as *const () as usize,
            moeblaze_get_device_count as *const () as usize,
            moeblaze_create as *const () as usize,
            moeblaze_create_ep as *const () as usize,
            moeblaze_create_ep_from_unique_id as *const () as usize,
            moeblaze_get_symmetric_size as *const () as usize,
            moeblaze_destroy as *const () as usize,
            moeblaze_handle_get_i64 as *const () as usize,
            moeblaze_handle_get_f64 as *const () as usize,
            moeblaze_handle_get_dtype as *const () as usize,
            moeblaze_get_workspace_size as *const () as usize,
            moeblaze_get_saved_size as *const () as usize,
            moeblaze_check_args as *const () as usize,
            moeblaze_forward as *const () as usize,
            moeblaze_backward as *const () as usize,
            moeblaze_backward_last_use as *const () as usize,
            moeblaze_route as *const () as usize,
            moeblaze_assert_status as *const () as usize,
        ];
        assert!(ptrs.iter().all(|&p| p != 0));
        assert_eq!(ptrs.len(), declared_functions().len());
    }

    /// The `pub fn` names inside this file's `extern "C"` block.
    fn declared_functions() -> Vec<String> {
        let src = include_str!("lib.rs");
        let start = src.find("extern \"C\" {").expect("extern block");
        let end = start + src[start..].find("\n}\n").expect("end of extern block");
        let mut names: Vec<String> = src[start..end]
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub fn "))
            .map(|l| l.split('(').next().unwrap().trim().to_string())
            .collect();
        names.sort();
        names
    }

    /// tests/abi/exported-symbols.txt (one symbol a line, sorted), or failing that the
    /// `global:` entries of src/libmoeblaze.map.
    fn expected_symbols() -> (Vec<String>, String) {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../..");
        let list = std::format!("{root}/tests/abi/exported-symbols.txt");
        if let Ok(text) = std::fs::read_to_string(&list) {
            let mut v: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect();
            v.sort();
            return (v, list);
        }
        let map = std::format!("{root}/src/libmoeblaze.map");
        let text = std::fs::read_to_string(&map)
            .unwrap_or_else(|e| panic!("neither {list} nor {map} is readable: {e}"));
        let globals = text.split("global:").nth(1).expect("global: section");
        let globals = globals.split("local:").next().unwrap();
        let mut v: Vec<String> = globals
            .split(|c: char| c == ';' || c.is_whitespace())
            .filter(|s| s.starts_with("moeblaze_"))
            .map(String::from)
            .collect();
        v.sort();
        (v, map)
    }

    #[test]
    fn extern_block_matches_exported_symbols() {
        let (expected, source) = expected_symbols();
        let declared = declared_functions();
        let missing: Vec<_> = expected.iter().filter(|s| !declared.contains(s)).collect();
        let extra: Vec<_> = declared.iter().filter(|s| !expected.contains(s)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "extern block differs from {source}: missing {missing:?}, not exported {extra:?}"
        );
    }

    #[test]
    fn unknown_status_has_a_name() {
        let name = unsafe { core::ffi::CStr::from_ptr(moeblaze_status_name(4242)) };
        assert_eq!(name.to_str().unwrap(), "MOEBLAZE_STATUS_UNKNOWN");
    }
}
