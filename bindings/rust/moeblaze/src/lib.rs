//! Safe wrapper of libmoeblaze, the MoEBlaze stable C ABI for Mixture-of-Experts layers.
//!
//! * [`Config`] is a builder over `moeblaze_config_t` (dropped with `moeblaze_config_destroy`).
//! * [`Handle`] owns a `moeblaze_handle_t` (dropped with `moeblaze_destroy`). Handles are
//!   immutable after creation, so `Handle` is `Send + Sync`.
//! * [`TensorRef`] and [`Arg`] are `#[repr(transparent)]` over the C structs and borrow their
//!   shape/stride slices (and, for host slices, the data) for their lifetime `'a`.
//! * [`Handle::forward`], [`Handle::backward`] and [`Handle::route`] are `unsafe`: device
//!   pointers cannot be checked. Their `# Safety` sections list the contract.
//! * Every failing call returns an [`Error`] with the [`Status`] and the library's thread-local
//!   message, copied immediately on the calling thread.
//!
//! ```no_run
//! use moeblaze::{Arg, ArgKind, Config, Device, DType, HostBuffer, Pass, Stream, TensorRef};
//! # fn main() -> Result<(), moeblaze::Error> {
//! let mut cfg = Config::new()?;
//! cfg.num_experts(4)?.top_k(2)?.hidden_size(8)?.ffn_hidden_size(12)?.max_tokens(16)?
//!    .device(Device::CPU)?.activation_dtype(DType::F32)?.weight_dtype(DType::F32)?;
//! let handle = cfg.create()?;
//! let ws = HostBuffer::new(handle.workspace_size(Pass::FORWARD_INFERENCE, 5)?);
//! # Ok(()) }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

pub use moeblaze_sys as sys;

use std::alloc::{self, Layout};
use std::ffi::{c_void, CStr};
use std::fmt;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::OnceLock;

// ---- status and errors -----------------------------------------------------------------------

/// A status of the C API. Values this crate does not know map to [`Status::Unknown`].
#[non_exhaustive]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Success,
    InvalidArgument,
    NotSupported,
    InsufficientWorkspace,
    OutOfHostMemory,
    OutOfDeviceMemory,
    CudaError,
    CublasError,
    ArchMismatch,
    VersionMismatch,
    UnknownAttribute,
    AttributeTypeMismatch,
    InternalError,
    /// A value this crate does not know (a newer library).
    Unknown(i32),
}

impl Status {
    /// Converts a raw `moeblaze_status_t`; never fails.
    pub fn from_raw(raw: i32) -> Status {
        match raw {
            sys::MOEBLAZE_STATUS_SUCCESS => Status::Success,
            sys::MOEBLAZE_STATUS_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::MOEBLAZE_STATUS_NOT_SUPPORTED => Status::NotSupported,
            sys::MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE => Status::InsufficientWorkspace,
            sys::MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY => Status::OutOfHostMemory,
            sys::MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY => Status::OutOfDeviceMemory,
            sys::MOEBLAZE_STATUS_CUDA_ERROR => Status::CudaError,
            sys::MOEBLAZE_STATUS_CUBLAS_ERROR => Status::CublasError,
            sys::MOEBLAZE_STATUS_ARCH_MISMATCH => Status::ArchMismatch,
            sys::MOEBLAZE_STATUS_VERSION_MISMATCH => Status::VersionMismatch,
            sys::MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE => Status::UnknownAttribute,
            sys::MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH => Status::AttributeTypeMismatch,
            sys::MOEBLAZE_STATUS_INTERNAL_ERROR => Status::InternalError,
            other => Status::Unknown(other),
        }
    }

    /// The raw `moeblaze_status_t` value.
    pub fn raw(self) -> i32 {
        match self {
            Status::Success => sys::MOEBLAZE_STATUS_SUCCESS,
            Status::InvalidArgument => sys::MOEBLAZE_STATUS_INVALID_ARGUMENT,
            Status::NotSupported => sys::MOEBLAZE_STATUS_NOT_SUPPORTED,
            Status::InsufficientWorkspace => sys::MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE,
            Status::OutOfHostMemory => sys::MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY,
            Status::OutOfDeviceMemory => sys::MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY,
            Status::CudaError => sys::MOEBLAZE_STATUS_CUDA_ERROR,
            Status::CublasError => sys::MOEBLAZE_STATUS_CUBLAS_ERROR,
            Status::ArchMismatch => sys::MOEBLAZE_STATUS_ARCH_MISMATCH,
            Status::VersionMismatch => sys::MOEBLAZE_STATUS_VERSION_MISMATCH,
            Status::UnknownAttribute => sys::MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE,
            Status::AttributeTypeMismatch => sys::MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH,
            Status::InternalError => sys::MOEBLAZE_STATUS_INTERNAL_ERROR,
            Status::Unknown(v) => v,
        }
    }

    /// `moeblaze_status_name`, e.g. "MOEBLAZE_STATUS_INVALID_ARGUMENT".
    pub fn name(self) -> &'static str {
        // SAFETY: returns a static, never-NULL string for any value.
        unsafe { static_str(sys::moeblaze_status_name(self.raw())) }
    }

    /// `moeblaze_status_string`: a one-sentence description.
    pub fn description(self) -> &'static str {
        // SAFETY: as above.
        unsafe { static_str(sys::moeblaze_status_string(self.raw())) }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call: its status and the library's message (copied right after the call).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    /// An error detected by this crate before calling the library.
    pub fn binding(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.name(),
            self.status.raw(),
            self.message
        )
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// # Safety
/// `p` must be NULL or a NUL-terminated string that lives for the rest of the program.
unsafe fn static_str(p: *const std::ffi::c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // SAFETY: per the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .unwrap_or("<invalid UTF-8>")
}

/// The calling thread's last error message (a copy).
pub fn last_error_message() -> String {
    // SAFETY: never NULL; valid until the next call on this thread, and copied at once.
    unsafe { CStr::from_ptr(sys::moeblaze_get_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Converts a raw status into a `Result`, copying the message immediately on failure.
pub fn check(raw: i32) -> Result<()> {
    if raw == sys::MOEBLAZE_STATUS_SUCCESS {
        Ok(())
    } else {
        let message = last_error_message();
        Err(Error {
            status: Status::from_raw(raw),
            message,
        })
    }
}

// ---- version ------------------------------------------------------------------------------

/// Run-time library version, encoded as major*1000000 + minor*1000 + patch.
pub fn version() -> u32 {
    unsafe { sys::moeblaze_get_version() }
}
/// Run-time version string such as "0.2.0".
pub fn version_string() -> &'static str {
    unsafe { static_str(sys::moeblaze_get_version_string()) }
}
/// Run-time ABI version.
pub fn abi_version() -> u32 {
    unsafe { sys::moeblaze_get_abi_version() }
}
/// Build description (version, git revision, build type, CUDA version and SM list).
pub fn build_info() -> &'static str {
    unsafe { static_str(sys::moeblaze_get_build_info()) }
}

/// Refuses a library whose ABI differs from [`sys::MOEBLAZE_ABI_VERSION`]. Called by
/// [`Config::new`]; the answer is computed once.
pub fn check_abi() -> Result<()> {
    static ABI: OnceLock<u32> = OnceLock::new();
    let abi = *ABI.get_or_init(abi_version);
    if abi == sys::MOEBLAZE_ABI_VERSION {
        Ok(())
    } else {
        Err(Error::binding(
            Status::VersionMismatch,
            format!(
                "libmoeblaze reports ABI version {abi}, but this crate was written for ABI {}",
                sys::MOEBLAZE_ABI_VERSION
            ),
        ))
    }
}

/// Number of devices of a type this build can use (1 for the CPU).
pub fn device_count(device_type: DeviceType) -> Result<i32> {
    let mut n = 0i32;
    check(unsafe { sys::moeblaze_get_device_count(device_type.0, &mut n) })?;
    Ok(n)
}

// ---- enums as newtypes over integers -------------------------------------------------------

macro_rules! int_newtype {
    ($(#[$m:meta])* $name:ident($ty:ty) { $($(#[$cm:meta])* $c:ident = $v:expr,)* }) => {
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(pub $ty);
        impl $name {
            $($(#[$cm])* pub const $c: $name = $name($v);)*
            /// The constant's name, or None for a value this crate does not know.
            pub fn name(self) -> Option<&'static str> {
                match self.0 {
                    $(v if v == $v => Some(stringify!($c)),)*
                    _ => None,
                }
            }
        }
    };
}

int_newtype!(
    /// `moeblaze_attr_t`. Use [`Attr::from_name`] for attributes this crate does not list.
    Attr(i32) {
        NUM_EXPERTS = sys::MOEBLAZE_ATTR_NUM_EXPERTS,
        TOP_K = sys::MOEBLAZE_ATTR_TOP_K,
        HIDDEN_SIZE = sys::MOEBLAZE_ATTR_HIDDEN_SIZE,
        FFN_HIDDEN_SIZE = sys::MOEBLAZE_ATTR_FFN_HIDDEN_SIZE,
        MAX_TOKENS = sys::MOEBLAZE_ATTR_MAX_TOKENS,
        ACTIVATION = sys::MOEBLAZE_ATTR_ACTIVATION,
        SCORE_FUNCTION = sys::MOEBLAZE_ATTR_SCORE_FUNCTION,
        NORMALIZE_TOPK = sys::MOEBLAZE_ATTR_NORMALIZE_TOPK,
        AUX_LOSS_COEFF = sys::MOEBLAZE_ATTR_AUX_LOSS_COEFF,
        Z_LOSS_COEFF = sys::MOEBLAZE_ATTR_Z_LOSS_COEFF,
        ACTIVATION_DTYPE = sys::MOEBLAZE_ATTR_ACTIVATION_DTYPE,
        WEIGHT_DTYPE = sys::MOEBLAZE_ATTR_WEIGHT_DTYPE,
        ACCUM_DTYPE = sys::MOEBLAZE_ATTR_ACCUM_DTYPE,
        SAVE_POLICY = sys::MOEBLAZE_ATTR_SAVE_POLICY,
        DETERMINISTIC = sys::MOEBLAZE_ATTR_DETERMINISTIC,
        DEVICE_TYPE = sys::MOEBLAZE_ATTR_DEVICE_TYPE,
        DEVICE_ID = sys::MOEBLAZE_ATTR_DEVICE_ID,
        ENGINE = sys::MOEBLAZE_ATTR_ENGINE,
        NUM_THREADS = sys::MOEBLAZE_ATTR_NUM_THREADS,
        WINDOW_TOKENS = sys::MOEBLAZE_ATTR_WINDOW_TOKENS,
        EP_MAX_RECV_TOKENS = sys::MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS,
        EP_TRANSPORT = sys::MOEBLAZE_ATTR_EP_TRANSPORT,
        EP_COMM_SMS = sys::MOEBLAZE_ATTR_EP_COMM_SMS,
        EP_SIZE = sys::MOEBLAZE_ATTR_EP_SIZE,
        EP_RANK = sys::MOEBLAZE_ATTR_EP_RANK,
        NUM_EXPERT_GROUPS = sys::MOEBLAZE_ATTR_NUM_EXPERT_GROUPS,
        TOPK_GROUPS = sys::MOEBLAZE_ATTR_TOPK_GROUPS,
        ROUTE_SCALE = sys::MOEBLAZE_ATTR_ROUTE_SCALE,
        AUX_LOSS_FORM = sys::MOEBLAZE_ATTR_AUX_LOSS_FORM,
    }
);

int_newtype!(
    /// `moeblaze_pass_t`.
    Pass(i32) {
        FORWARD_TRAINING = sys::MOEBLAZE_PASS_FORWARD_TRAINING,
        FORWARD_INFERENCE = sys::MOEBLAZE_PASS_FORWARD_INFERENCE,
        BACKWARD = sys::MOEBLAZE_PASS_BACKWARD,
        ROUTE = sys::MOEBLAZE_PASS_ROUTE,
        BACKWARD_LAST_USE = sys::MOEBLAZE_PASS_BACKWARD_LAST_USE,
    }
);

int_newtype!(
    /// `moeblaze_arg_kind_t`.
    ArgKind(i32) {
        INPUT = sys::MOEBLAZE_ARG_INPUT,
        ROUTER_WEIGHT = sys::MOEBLAZE_ARG_ROUTER_WEIGHT,
        ROUTER_LOGITS = sys::MOEBLAZE_ARG_ROUTER_LOGITS,
        EXPERT_BIAS = sys::MOEBLAZE_ARG_EXPERT_BIAS,
        W_GATE_UP = sys::MOEBLAZE_ARG_W_GATE_UP,
        W_DOWN = sys::MOEBLAZE_ARG_W_DOWN,
        TOPK_INDICES = sys::MOEBLAZE_ARG_TOPK_INDICES,
        TOPK_WEIGHTS = sys::MOEBLAZE_ARG_TOPK_WEIGHTS,
        SEQUENCE_LENGTHS = sys::MOEBLAZE_ARG_SEQUENCE_LENGTHS,
        TOKEN_MASK = sys::MOEBLAZE_ARG_TOKEN_MASK,
        OUTPUT = sys::MOEBLAZE_ARG_OUTPUT,
        AUX_LOSS = sys::MOEBLAZE_ARG_AUX_LOSS,
        TOKENS_PER_EXPERT = sys::MOEBLAZE_ARG_TOKENS_PER_EXPERT,
        Z_LOSS = sys::MOEBLAZE_ARG_Z_LOSS,
        STATUS = sys::MOEBLAZE_ARG_STATUS,
        GRAD_OUTPUT = sys::MOEBLAZE_ARG_GRAD_OUTPUT,
        GRAD_AUX_LOSS = sys::MOEBLAZE_ARG_GRAD_AUX_LOSS,
        GRAD_Z_LOSS = sys::MOEBLAZE_ARG_GRAD_Z_LOSS,
        GRAD_INPUT = sys::MOEBLAZE_ARG_GRAD_INPUT,
        GRAD_ROUTER_WEIGHT = sys::MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT,
        GRAD_ROUTER_LOGITS = sys::MOEBLAZE_ARG_GRAD_ROUTER_LOGITS,
        GRAD_W_GATE_UP = sys::MOEBLAZE_ARG_GRAD_W_GATE_UP,
        GRAD_W_DOWN = sys::MOEBLAZE_ARG_GRAD_W_DOWN,
        GRAD_TOPK_WEIGHTS = sys::MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS,
    }
);

int_newtype!(
    /// `moeblaze_device_type_t`.
    DeviceType(i32) {
        CPU = sys::MOEBLAZE_DEVICE_CPU,
        CUDA = sys::MOEBLAZE_DEVICE_CUDA,
    }
);

int_newtype!(
    /// `moeblaze_activation_t` (the value of [`Attr::ACTIVATION`]).
    Activation(i64) {
        RELU = sys::MOEBLAZE_ACTIVATION_RELU as i64,
        GELU = sys::MOEBLAZE_ACTIVATION_GELU as i64,
        SILU = sys::MOEBLAZE_ACTIVATION_SILU as i64,
        SWIGLU = sys::MOEBLAZE_ACTIVATION_SWIGLU as i64,
        GEGLU = sys::MOEBLAZE_ACTIVATION_GEGLU as i64,
    }
);

int_newtype!(
    /// `moeblaze_score_fn_t` (the value of [`Attr::SCORE_FUNCTION`]).
    ScoreFn(i64) {
        SOFTMAX = sys::MOEBLAZE_SCORE_SOFTMAX as i64,
        SIGMOID = sys::MOEBLAZE_SCORE_SIGMOID as i64,
    }
);

int_newtype!(
    /// `moeblaze_aux_loss_form_t` (the value of [`Attr::AUX_LOSS_FORM`]).
    AuxLossForm(i64) {
        SWITCH = sys::MOEBLAZE_AUX_LOSS_SWITCH as i64,
        HUGGING_FACE = sys::MOEBLAZE_AUX_LOSS_HUGGING_FACE as i64,
    }
);

int_newtype!(
    /// `moeblaze_save_policy_t` (the value of [`Attr::SAVE_POLICY`]).
    SavePolicy(i64) {
        PREACT = sys::MOEBLAZE_SAVE_PREACT as i64,
        RECOMPUTE_UP = sys::MOEBLAZE_SAVE_RECOMPUTE_UP as i64,
        ALL = sys::MOEBLAZE_SAVE_ALL as i64,
    }
);

int_newtype!(
    /// `moeblaze_engine_t` (the value of [`Attr::ENGINE`]).
    Engine(i64) {
        AUTO = sys::MOEBLAZE_ENGINE_AUTO as i64,
        CPU = sys::MOEBLAZE_ENGINE_CPU as i64,
        CUDA_CUBLASLT = sys::MOEBLAZE_ENGINE_CUDA_CUBLASLT as i64,
        CUDA_FUSED = sys::MOEBLAZE_ENGINE_CUDA_FUSED as i64,
    }
);

int_newtype!(
    /// `moeblaze_value_type_t`.
    ValueType(i32) {
        I64 = sys::MOEBLAZE_VALUE_I64,
        F64 = sys::MOEBLAZE_VALUE_F64,
        DTYPE = sys::MOEBLAZE_VALUE_DTYPE,
    }
);

/// `moeblaze_dtype_t` (DLPack `DLDataType`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct DType(pub sys::moeblaze_dtype_t);

impl DType {
    pub const F32: DType = DType(sys::MOEBLAZE_DTYPE_F32);
    pub const F16: DType = DType(sys::MOEBLAZE_DTYPE_F16);
    pub const BF16: DType = DType(sys::MOEBLAZE_DTYPE_BF16);
    pub const I32: DType = DType(sys::MOEBLAZE_DTYPE_I32);
    pub const I64: DType = DType(sys::MOEBLAZE_DTYPE_I64);
    /// Bytes per element.
    pub fn size(self) -> usize {
        (self.0.bits as usize * self.0.lanes as usize).div_ceil(8)
    }
}

/// `moeblaze_device_t` (DLPack `DLDevice`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct Device(pub sys::moeblaze_device_t);

impl Device {
    pub const CPU: Device = Device(sys::moeblaze_device_t {
        device_type: sys::MOEBLAZE_DEVICE_CPU,
        device_id: 0,
    });
    pub const fn cuda(id: i32) -> Device {
        Device(sys::moeblaze_device_t {
            device_type: sys::MOEBLAZE_DEVICE_CUDA,
            device_id: id,
        })
    }
    pub fn device_type(self) -> DeviceType {
        DeviceType(self.0.device_type)
    }
    pub fn id(self) -> i32 {
        self.0.device_id
    }
}

/// A CUDA stream (`cudaStream_t`); [`Stream::DEFAULT`] is the legacy default stream. CPU
/// handles ignore it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Stream(pub *mut sys::CUstream_st);

impl Stream {
    pub const DEFAULT: Stream = Stream(ptr::null_mut());
}
impl Default for Stream {
    fn default() -> Self {
        Stream::DEFAULT
    }
}
// SAFETY: a stream is an opaque token that CUDA lets any thread use.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

// ---- attributes ---------------------------------------------------------------------------

/// What `moeblaze_attr_query` says about an attribute.
#[derive(Clone, Debug, PartialEq)]
pub struct AttrInfo {
    pub attr: Attr,
    pub name: &'static str,
    pub value_type: ValueType,
    pub required: bool,
    pub min_i64: i64,
    pub max_i64: i64,
    pub default_i64: i64,
    pub default_f64: f64,
    pub since_version: u32,
}

impl Attr {
    /// Describes this attribute (`moeblaze_attr_query`).
    pub fn info(self) -> Result<AttrInfo> {
        // SAFETY: zero is a valid bit pattern for every field (NULL pointer, zero integers).
        let mut raw: sys::moeblaze_attr_info_t = unsafe { std::mem::zeroed() };
        raw.struct_size = std::mem::size_of::<sys::moeblaze_attr_info_t>();
        check(unsafe { sys::moeblaze_attr_query(self.0, &mut raw) })?;
        Ok(AttrInfo {
            attr: self,
            // SAFETY: the name is a static string.
            name: unsafe { static_str(raw.name) },
            value_type: ValueType(raw.value_type),
            required: raw.required != 0,
            min_i64: raw.min_i64,
            max_i64: raw.max_i64,
            default_i64: raw.default_i64,
            default_f64: raw.default_f64,
            since_version: raw.since_version,
        })
    }

    /// The attribute called `name` (e.g. "top_k") by the loaded library, if any.
    pub fn from_name(name: &str) -> Option<Attr> {
        attributes()
            .into_iter()
            .find(|a| a.name == name)
            .map(|a| a.attr)
    }
}

/// Every attribute the loaded library knows (numbers are dense; probing stops at the first
/// unknown one).
pub fn attributes() -> Vec<AttrInfo> {
    let mut out = Vec::new();
    for n in 0..4096 {
        match Attr(n).info() {
            Ok(info) => out.push(info),
            Err(_) => break,
        }
    }
    out
}

// ---- config -------------------------------------------------------------------------------

/// A value for [`Config::set`].
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Value {
    I64(i64),
    F64(f64),
    DType(DType),
}

/// Builder over `moeblaze_config_t`. Single-writer: `&mut self` for every change.
#[derive(Debug)]
pub struct Config {
    raw: NonNull<sys::moeblaze_config_s>,
}

// SAFETY: a config may be used from any thread, one at a time (&mut for writes).
unsafe impl Send for Config {}

impl Config {
    /// A config with every attribute at its default. Checks the library's ABI first.
    pub fn new() -> Result<Config> {
        check_abi()?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::moeblaze_config_create(&mut raw) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::binding(Status::InternalError, "config_create returned NULL"))?;
        Ok(Config { raw })
    }

    pub fn as_raw(&self) -> sys::moeblaze_config_t {
        self.raw.as_ptr()
    }

    pub fn set_i64(&mut self, attr: Attr, value: i64) -> Result<&mut Self> {
        check(unsafe { sys::moeblaze_config_set_i64(self.as_raw(), attr.0, value) })?;
        Ok(self)
    }
    pub fn set_f64(&mut self, attr: Attr, value: f64) -> Result<&mut Self> {
        check(unsafe { sys::moeblaze_config_set_f64(self.as_raw(), attr.0, value) })?;
        Ok(self)
    }
    pub fn set_dtype(&mut self, attr: Attr, value: DType) -> Result<&mut Self> {
        check(unsafe { sys::moeblaze_config_set_dtype(self.as_raw(), attr.0, value.0) })?;
        Ok(self)
    }
    /// Sets an attribute by its library name (e.g. "top_k"), for attributes newer than this
    /// crate.
    pub fn set(&mut self, name: &str, value: Value) -> Result<&mut Self> {
        let attr = Attr::from_name(name).ok_or_else(|| {
            Error::binding(
                Status::UnknownAttribute,
                format!("unknown attribute {name:?}"),
            )
        })?;
        match value {
            Value::I64(v) => self.set_i64(attr, v),
            Value::F64(v) => self.set_f64(attr, v),
            Value::DType(v) => self.set_dtype(attr, v),
        }
    }

    pub fn get_i64(&self, attr: Attr) -> Result<i64> {
        let mut v = 0;
        check(unsafe { sys::moeblaze_config_get_i64(self.as_raw(), attr.0, &mut v) })?;
        Ok(v)
    }
    pub fn get_f64(&self, attr: Attr) -> Result<f64> {
        let mut v = 0.0;
        check(unsafe { sys::moeblaze_config_get_f64(self.as_raw(), attr.0, &mut v) })?;
        Ok(v)
    }
    pub fn get_dtype(&self, attr: Attr) -> Result<DType> {
        let mut v = sys::moeblaze_dtype_t::default();
        check(unsafe { sys::moeblaze_config_get_dtype(self.as_raw(), attr.0, &mut v) })?;
        Ok(DType(v))
    }

    pub fn num_experts(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::NUM_EXPERTS, v)
    }
    pub fn top_k(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::TOP_K, v)
    }
    pub fn hidden_size(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::HIDDEN_SIZE, v)
    }
    pub fn ffn_hidden_size(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::FFN_HIDDEN_SIZE, v)
    }
    pub fn max_tokens(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::MAX_TOKENS, v)
    }
    pub fn activation(&mut self, v: Activation) -> Result<&mut Self> {
        self.set_i64(Attr::ACTIVATION, v.0)
    }
    pub fn score_function(&mut self, v: ScoreFn) -> Result<&mut Self> {
        self.set_i64(Attr::SCORE_FUNCTION, v.0)
    }
    pub fn normalize_topk(&mut self, v: bool) -> Result<&mut Self> {
        self.set_i64(Attr::NORMALIZE_TOPK, v as i64)
    }
    pub fn aux_loss_coeff(&mut self, v: f64) -> Result<&mut Self> {
        self.set_f64(Attr::AUX_LOSS_COEFF, v)
    }
    pub fn z_loss_coeff(&mut self, v: f64) -> Result<&mut Self> {
        self.set_f64(Attr::Z_LOSS_COEFF, v)
    }
    pub fn activation_dtype(&mut self, v: DType) -> Result<&mut Self> {
        self.set_dtype(Attr::ACTIVATION_DTYPE, v)
    }
    pub fn weight_dtype(&mut self, v: DType) -> Result<&mut Self> {
        self.set_dtype(Attr::WEIGHT_DTYPE, v)
    }
    pub fn save_policy(&mut self, v: SavePolicy) -> Result<&mut Self> {
        self.set_i64(Attr::SAVE_POLICY, v.0)
    }
    pub fn deterministic(&mut self, v: bool) -> Result<&mut Self> {
        self.set_i64(Attr::DETERMINISTIC, v as i64)
    }
    /// Sets DEVICE_TYPE and DEVICE_ID.
    pub fn device(&mut self, d: Device) -> Result<&mut Self> {
        self.set_i64(Attr::DEVICE_TYPE, d.0.device_type as i64)?;
        self.set_i64(Attr::DEVICE_ID, d.0.device_id as i64)
    }
    pub fn engine(&mut self, v: Engine) -> Result<&mut Self> {
        self.set_i64(Attr::ENGINE, v.0)
    }
    pub fn num_threads(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::NUM_THREADS, v)
    }
    /// Tokens per window of the CUDA fused engine's expert pass (0: automatic).
    pub fn window_tokens(&mut self, v: i64) -> Result<&mut Self> {
        self.set_i64(Attr::WINDOW_TOKENS, v)
    }

    /// Validates the config and creates a handle (`moeblaze_create`). The config is copied.
    pub fn create(&self) -> Result<Handle> {
        Handle::new(self)
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: we own the config; destroy always succeeds.
        unsafe { sys::moeblaze_config_destroy(self.raw.as_ptr()) };
    }
}

// ---- tensors and arguments ----------------------------------------------------------------

/// Element types with a moeblaze dtype, for host slices.
///
/// # Safety
/// `DTYPE` must describe `Self` exactly (size and representation).
pub unsafe trait Element: Copy {
    const DTYPE: DType;
}
unsafe impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
unsafe impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
unsafe impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

/// A tensor descriptor (`moeblaze_tensor_t`, 48 bytes) that borrows its shape and strides —
/// and, when built from a host slice, its data — for `'a`.
#[derive(Copy, Clone, Debug)]
#[repr(transparent)]
pub struct TensorRef<'a> {
    raw: sys::moeblaze_tensor_t,
    _borrow: PhantomData<&'a [i64]>,
}

fn numel(shape: &[i64]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &s| usize::try_from(s).ok()?.checked_mul(acc))
}

impl<'a> TensorRef<'a> {
    /// A descriptor over any memory (host or device). Building it is safe; passing it to
    /// [`Handle::forward`] and friends is where the pointer must be valid.
    pub fn from_raw_parts(
        data: *mut c_void,
        device: Device,
        dtype: DType,
        shape: &'a [i64],
        strides: Option<&'a [i64]>,
    ) -> Result<TensorRef<'a>> {
        if let Some(s) = strides {
            if s.len() != shape.len() {
                return Err(Error::binding(
                    Status::InvalidArgument,
                    "strides and shape differ in length",
                ));
            }
        }
        let ndim = i32::try_from(shape.len())
            .map_err(|_| Error::binding(Status::InvalidArgument, "too many dimensions"))?;
        Ok(TensorRef {
            raw: sys::moeblaze_tensor_t {
                data,
                device: device.0,
                ndim,
                dtype: dtype.0,
                shape: if shape.is_empty() {
                    ptr::null()
                } else {
                    shape.as_ptr()
                },
                strides: strides.map_or(ptr::null(), |s| s.as_ptr()),
                byte_offset: 0,
            },
            _borrow: PhantomData,
        })
    }

    fn host_checked<T: Element>(
        data: *mut T,
        len: usize,
        shape: &'a [i64],
    ) -> Result<TensorRef<'a>> {
        let n = numel(shape)
            .ok_or_else(|| Error::binding(Status::InvalidArgument, "negative or huge shape"))?;
        if n != len {
            return Err(Error::binding(
                Status::InvalidArgument,
                format!("shape {shape:?} has {n} elements but the slice has {len}"),
            ));
        }
        TensorRef::from_raw_parts(data.cast(), Device::CPU, T::DTYPE, shape, None)
    }

    /// A read-only host (CPU) input over a contiguous slice; `shape` must match its length
    /// (an empty shape is a scalar of one element).
    pub fn host<T: Element>(data: &'a [T], shape: &'a [i64]) -> Result<TensorRef<'a>> {
        TensorRef::host_checked(data.as_ptr().cast_mut(), data.len(), shape)
    }

    /// A writable host (CPU) tensor over a contiguous slice (outputs and gradients).
    pub fn host_mut<T: Element>(data: &'a mut [T], shape: &'a [i64]) -> Result<TensorRef<'a>> {
        TensorRef::host_checked(data.as_mut_ptr(), data.len(), shape)
    }

    /// Overrides the dtype (e.g. bf16 data held in a `u16`-sized raw buffer).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.raw.dtype = dtype.0;
        self
    }

    pub fn with_byte_offset(mut self, byte_offset: u64) -> Self {
        self.raw.byte_offset = byte_offset;
        self
    }

    pub fn as_raw(&self) -> &sys::moeblaze_tensor_t {
        &self.raw
    }
}

/// One argument (`moeblaze_arg_t`, 56 bytes); a slice of these is passed to the C API as-is.
#[derive(Copy, Clone, Debug)]
#[repr(transparent)]
pub struct Arg<'a> {
    raw: sys::moeblaze_arg_t,
    _borrow: PhantomData<TensorRef<'a>>,
}

impl<'a> Arg<'a> {
    pub fn new(kind: ArgKind, tensor: TensorRef<'a>) -> Arg<'a> {
        Arg {
            raw: sys::moeblaze_arg_t {
                kind: kind.0,
                flags: 0,
                tensor: tensor.raw,
            },
            _borrow: PhantomData,
        }
    }
    /// A gradient output with `MOEBLAZE_ARG_FLAG_ACCUMULATE` (add instead of overwrite).
    pub fn accumulate(mut self) -> Arg<'a> {
        self.raw.flags |= sys::MOEBLAZE_ARG_FLAG_ACCUMULATE;
        self
    }
    pub fn with_flags(mut self, flags: u32) -> Arg<'a> {
        self.raw.flags = flags;
        self
    }
    pub fn kind(&self) -> ArgKind {
        ArgKind(self.raw.kind)
    }
    pub fn as_raw(&self) -> &sys::moeblaze_arg_t {
        &self.raw
    }
}

fn args_ptr(args: &[Arg<'_>]) -> *const sys::moeblaze_arg_t {
    // Arg is repr(transparent) over moeblaze_arg_t.
    args.as_ptr().cast()
}

// ---- host buffers ---------------------------------------------------------------------------

/// Zeroed host memory aligned to [`sys::MOEBLAZE_BUFFER_ALIGNMENT`] (256 bytes), for the
/// workspace and saved buffers of CPU handles.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: plain owned memory.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    pub fn new(len: usize) -> HostBuffer {
        let layout = Layout::from_size_align(len.max(1), sys::MOEBLAZE_BUFFER_ALIGNMENT)
            .expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        HostBuffer { ptr, len, layout }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *const c_void {
        self.ptr.as_ptr().cast()
    }
    pub fn as_mut_ptr(&mut self) -> *mut c_void {
        self.ptr.as_ptr().cast()
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: len bytes were allocated and zeroed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in new().
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({} bytes at {:p})", self.len, self.ptr)
    }
}

// ---- handle -------------------------------------------------------------------------------

/// An immutable, validated layer bound to one device and engine (`moeblaze_handle_t`).
#[derive(Debug)]
pub struct Handle(NonNull<sys::moeblaze_handle_s>);

// SAFETY: moeblaze.h documents handles as immutable after moeblaze_create: forward, backward,
// route and the size queries may run concurrently on one handle from many threads, as long as
// each in-flight call has its own workspace and saved buffer (which the unsafe contracts of
// those calls require). Destruction needs ownership (Drop), so no call can race with it.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    /// `moeblaze_create`: validates the config and creates a handle.
    pub fn new(cfg: &Config) -> Result<Handle> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::moeblaze_create(&mut raw, cfg.as_raw()) })?;
        NonNull::new(raw)
            .map(Handle)
            .ok_or_else(|| Error::binding(Status::InternalError, "moeblaze_create returned NULL"))
    }

    pub fn as_raw(&self) -> sys::moeblaze_handle_t {
        self.0.as_ptr()
    }

    pub fn get_i64(&self, attr: Attr) -> Result<i64> {
        let mut v = 0;
        check(unsafe { sys::moeblaze_handle_get_i64(self.as_raw(), attr.0, &mut v) })?;
        Ok(v)
    }
    pub fn get_f64(&self, attr: Attr) -> Result<f64> {
        let mut v = 0.0;
        check(unsafe { sys::moeblaze_handle_get_f64(self.as_raw(), attr.0, &mut v) })?;
        Ok(v)
    }
    pub fn get_dtype(&self, attr: Attr) -> Result<DType> {
        let mut v = sys::moeblaze_dtype_t::default();
        check(unsafe { sys::moeblaze_handle_get_dtype(self.as_raw(), attr.0, &mut v) })?;
        Ok(DType(v))
    }

    /// Scratch bytes a call with `num_tokens` tokens needs.
    pub fn workspace_size(&self, pass: Pass, num_tokens: i64) -> Result<usize> {
        let mut n = 0usize;
        check(unsafe {
            sys::moeblaze_get_workspace_size(self.as_raw(), pass.0, num_tokens, &mut n)
        })?;
        Ok(n)
    }

    /// Bytes a training forward keeps for backward.
    pub fn saved_size(&self, num_tokens: i64) -> Result<usize> {
        let mut n = 0usize;
        check(unsafe { sys::moeblaze_get_saved_size(self.as_raw(), num_tokens, &mut n) })?;
        Ok(n)
    }

    /// Validates arguments as the call for `pass` would (reads descriptors only, never data).
    pub fn check_args(&self, pass: Pass, args: &[Arg<'_>]) -> Result<()> {
        check(unsafe {
            sys::moeblaze_check_args(self.as_raw(), pass.0, args_ptr(args), args.len())
        })
    }

    /// `moeblaze_forward`: route, plan, expert MLPs, combine.
    ///
    /// # Safety
    /// * Every tensor's `data` (plus `byte_offset`) must point to memory on the handle's
    ///   device, valid for the extent its shape, strides and dtype describe; outputs must be
    ///   writable and must not alias inputs or each other.
    /// * `workspace` must be valid for `workspace_bytes` bytes and `saved` (training) for
    ///   `saved_bytes` bytes, both on the handle's device and 256-byte aligned
    ///   ([`HostBuffer`] is, for CPU handles).
    /// * For CUDA handles, the call only enqueues work on `stream`: every buffer (inputs,
    ///   outputs, workspace, saved) must stay valid and untouched by other work until that
    ///   work completes, and `stream` must be a valid stream of the handle's device.
    /// * The workspace must not be in use by another in-flight call.
    #[allow(clippy::too_many_arguments)] // mirrors the C signature
    pub unsafe fn forward(
        &self,
        pass: Pass,
        args: &[Arg<'_>],
        workspace: *mut c_void,
        workspace_bytes: usize,
        saved: *mut c_void,
        saved_bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        check(unsafe {
            sys::moeblaze_forward(
                self.as_raw(),
                pass.0,
                args_ptr(args),
                args.len(),
                workspace,
                workspace_bytes,
                saved,
                saved_bytes,
                stream.0,
            )
        })
    }

    /// `moeblaze_backward` from the saved buffer of a training forward of this handle with
    /// the same number of tokens.
    ///
    /// # Safety
    /// As [`Handle::forward`]; in addition `saved` must hold what a completed (or, on CUDA,
    /// earlier-enqueued on the same stream) training forward of this handle wrote for the
    /// same number of tokens, and must not be written while this call's work is in flight.
    pub unsafe fn backward(
        &self,
        args: &[Arg<'_>],
        saved: *const c_void,
        saved_bytes: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        check(unsafe {
            sys::moeblaze_backward(
                self.as_raw(),
                args_ptr(args),
                args.len(),
                saved,
                saved_bytes,
                workspace,
                workspace_bytes,
                stream.0,
            )
        })
    }

    /// `moeblaze_backward_last_use`: [`Handle::backward`] for the saved buffer's last use. It
    /// may write over `saved` (its workspace is `Pass::BACKWARD_LAST_USE`'s) and leaves it
    /// spent: a later backward on it is refused until a training forward writes it again.
    ///
    /// # Safety
    /// As [`Handle::backward`]; in addition nothing else may read or write `saved` while this
    /// call's work is in flight.
    pub unsafe fn backward_last_use(
        &self,
        args: &[Arg<'_>],
        saved: *mut c_void,
        saved_bytes: usize,
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        check(unsafe {
            sys::moeblaze_backward_last_use(
                self.as_raw(),
                args_ptr(args),
                args.len(),
                saved,
                saved_bytes,
                workspace,
                workspace_bytes,
                stream.0,
            )
        })
    }

    /// `moeblaze_route`: the router alone.
    ///
    /// # Safety
    /// As [`Handle::forward`] (without the saved buffer).
    pub unsafe fn route(
        &self,
        args: &[Arg<'_>],
        workspace: *mut c_void,
        workspace_bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        check(unsafe {
            sys::moeblaze_route(
                self.as_raw(),
                args_ptr(args),
                args.len(),
                workspace,
                workspace_bytes,
                stream.0,
            )
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: we own the handle; the unsafe contracts of forward/backward/route require
        // in-flight work to complete before the buffers (and so the caller's use) end.
        unsafe { sys::moeblaze_destroy(self.0.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_roundtrip_and_unknown() {
        for raw in 0..=12 {
            let s = Status::from_raw(raw);
            assert_eq!(s.raw(), raw);
            assert!(!matches!(s, Status::Unknown(_)));
            assert!(s.name().starts_with("MOEBLAZE_STATUS_"));
        }
        assert_eq!(Status::from_raw(77), Status::Unknown(77));
        assert_eq!(Status::Unknown(77).name(), "MOEBLAZE_STATUS_UNKNOWN");
        assert_eq!(
            Status::InvalidArgument.name(),
            "MOEBLAZE_STATUS_INVALID_ARGUMENT"
        );
    }

    #[test]
    fn newtype_layouts() {
        use std::mem::size_of;
        assert_eq!(size_of::<TensorRef<'_>>(), 48);
        assert_eq!(size_of::<Arg<'_>>(), 56);
        assert_eq!(size_of::<DType>(), 4);
        assert_eq!(size_of::<Device>(), 8);
        assert_eq!(ArgKind(4242).name(), None);
        assert_eq!(Attr::TOP_K.name(), Some("TOP_K"));
    }

    #[test]
    fn host_buffer_alignment() {
        for n in [0usize, 1, 255, 256, 1000] {
            let b = HostBuffer::new(n);
            assert_eq!(b.as_ptr() as usize % 256, 0);
            assert_eq!(b.as_slice().len(), n);
            assert!(b.as_slice().iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn shape_must_match_slice() {
        let data = [0f32; 6];
        let shape = [2i64, 3];
        assert!(TensorRef::host(&data, &shape).is_ok());
        let bad = [4i64, 2];
        let e = TensorRef::host(&data, &bad).unwrap_err();
        assert_eq!(e.status, Status::InvalidArgument);
    }
}
