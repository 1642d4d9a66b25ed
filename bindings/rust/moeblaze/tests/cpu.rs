//! Host tests of the safe crate against the CPU engine (device type CPU, f32).
#![allow(clippy::needless_range_loop)] // the reference mirrors the index notation of the math
use moeblaze::{
    attributes, Activation, Arg, ArgKind, Attr, Config, DType, Device, DeviceType, Engine, Error,
    Handle, HostBuffer, Pass, Status, Stream, TensorRef, ValueType,
};

const L: usize = 5;
const D: usize = 8;
const H: usize = 12;
const E: usize = 4;
const K: usize = 2;

fn config() -> Result<Config, Error> {
    let mut c = Config::new()?;
    c.num_experts(E as i64)?
        .top_k(K as i64)?
        .hidden_size(D as i64)?
        .ffn_hidden_size(H as i64)?
        .max_tokens(16)?
        .activation(Activation::SWIGLU)?
        .device(Device::CPU)?
        .activation_dtype(DType::F32)?
        .weight_dtype(DType::F32)?
        .num_threads(2)?;
    Ok(c)
}

/// Deterministic data in [-scale, scale).
fn lcg(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
        })
        .collect()
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}
fn dsilu(v: f64) -> f64 {
    let s = 1.0 / (1.0 + (-v).exp());
    s * (1.0 + v * (1.0 - s))
}

struct Reference {
    y: Vec<f64>,
    dx: Vec<f64>,
    dwgu: Vec<f64>,
    dwd: Vec<f64>,
    ids: Vec<i64>,
}

/// fp64 forward/backward of docs/design.md for softmax routing from logits and SwiGLU.
fn reference(x: &[f32], logits: &[f32], wgu: &[f32], wd: &[f32], dy: &[f32]) -> Reference {
    let gh = 2 * H;
    let mut r = Reference {
        y: vec![0.0; L * D],
        dx: vec![0.0; L * D],
        dwgu: vec![0.0; E * D * gh],
        dwd: vec![0.0; E * H * D],
        ids: vec![],
    };
    for t in 0..L {
        let row: Vec<f64> = (0..E).map(|e| logits[t * E + e] as f64).collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let scores: Vec<f64> = row.iter().map(|v| (v - m).exp() / sum).collect();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
        for &e in &order[..K] {
            r.ids.push(e as i64);
            let g = scores[e];
            let pre: Vec<f64> = (0..gh)
                .map(|c| {
                    (0..D)
                        .map(|i| x[t * D + i] as f64 * wgu[(e * D + i) * gh + c] as f64)
                        .sum()
                })
                .collect();
            let act: Vec<f64> = (0..H).map(|c| silu(pre[c]) * pre[H + c]).collect();
            for o in 0..D {
                let out: f64 = (0..H)
                    .map(|c| act[c] * wd[(e * H + c) * D + o] as f64)
                    .sum();
                r.y[t * D + o] += g * out;
            }
            let dact: Vec<f64> = (0..H)
                .map(|c| {
                    (0..D)
                        .map(|o| dy[t * D + o] as f64 * wd[(e * H + c) * D + o] as f64)
                        .sum()
                })
                .collect();
            for c in 0..H {
                for o in 0..D {
                    r.dwd[(e * H + c) * D + o] += act[c] * g * dy[t * D + o] as f64;
                }
            }
            let mut dpre = vec![0.0; gh];
            for c in 0..H {
                let da = g * dact[c];
                dpre[c] = da * pre[H + c] * dsilu(pre[c]);
                dpre[H + c] = da * silu(pre[c]);
            }
            for i in 0..D {
                for c in 0..gh {
                    r.dwgu[(e * D + i) * gh + c] += x[t * D + i] as f64 * dpre[c];
                    r.dx[t * D + i] += dpre[c] * wgu[(e * D + i) * gh + c] as f64;
                }
            }
        }
    }
    r
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((*a as f64 - b).abs()))
        / scale
}

#[test]
fn version_and_abi() {
    assert_eq!(moeblaze::abi_version(), moeblaze::sys::MOEBLAZE_ABI_VERSION);
    assert_eq!(moeblaze::version(), moeblaze::sys::MOEBLAZE_VERSION);
    assert!(moeblaze::build_info().contains(moeblaze::version_string()));
    moeblaze::check_abi().unwrap();
    assert_eq!(moeblaze::device_count(DeviceType::CPU).unwrap(), 1);
    assert_eq!(
        moeblaze::device_count(DeviceType(99)).unwrap_err().status,
        Status::InvalidArgument
    );
}

#[test]
fn attributes_come_from_the_library() {
    let attrs = attributes();
    assert!(attrs.len() >= moeblaze::sys::MOEBLAZE_ATTR_COUNT as usize);
    let top_k = attrs.iter().find(|a| a.name == "top_k").unwrap();
    assert_eq!(top_k.attr, Attr::TOP_K);
    assert!(top_k.required);
    assert_eq!(top_k.value_type, ValueType::I64);
    assert_eq!(
        Attr::from_name("aux_loss_coeff"),
        Some(Attr::AUX_LOSS_COEFF)
    );
    assert_eq!(
        Attr(100_000).info().unwrap_err().status,
        Status::UnknownAttribute
    );
}

#[test]
fn config_errors_carry_messages() {
    let mut c = Config::new().unwrap();
    let e = c.top_k(0).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("top_k"), "{e}");
    assert!(e.to_string().contains("MOEBLAZE_STATUS_INVALID_ARGUMENT"));
    assert_eq!(
        c.set_i64(Attr::AUX_LOSS_COEFF, 1).unwrap_err().status,
        Status::AttributeTypeMismatch
    );
    assert_eq!(
        c.set_i64(Attr(4242), 1).unwrap_err().status,
        Status::UnknownAttribute
    );
    assert_eq!(
        c.aux_loss_coeff(-1.0).unwrap_err().status,
        Status::InvalidArgument
    );
    let e = c
        .set("no_such_attribute", moeblaze::Value::I64(1))
        .unwrap_err();
    assert_eq!(e.status, Status::UnknownAttribute);
    // Required attributes missing.
    let e = c.create().unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("required"), "{e}");
    let mut c = config().unwrap();
    c.top_k(4).unwrap();
    c.num_experts(2).unwrap();
    assert!(c.create().unwrap_err().message.contains("top_k"));
    let c = config().unwrap();
    assert_eq!(c.get_i64(Attr::TOP_K).unwrap(), K as i64);
    assert_eq!(c.get_dtype(Attr::ACTIVATION_DTYPE).unwrap(), DType::F32);
    assert_eq!(c.get_f64(Attr::Z_LOSS_COEFF).unwrap(), 0.0);
}

#[test]
fn handle_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Handle>();
    let h = std::sync::Arc::new(config().unwrap().create().unwrap());
    assert_eq!(h.get_i64(Attr::ENGINE).unwrap(), Engine::CPU.0);
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let h = h.clone();
            std::thread::spawn(move || h.workspace_size(Pass::FORWARD_TRAINING, i).unwrap())
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap() % 256, 0);
    }
    assert_eq!(
        h.saved_size(17).unwrap_err().status,
        Status::InvalidArgument
    );
}

#[test]
fn cpu_forward_backward_matches_reference() {
    let x = lcg(1, L * D, 1.0);
    let logits = lcg(2, L * E, 2.0);
    let wgu = lcg(3, E * D * 2 * H, 0.5);
    let wd = lcg(4, E * H * D, 0.5);
    let dy = lcg(5, L * D, 1.0);
    let r = reference(&x, &logits, &wgu, &wd, &dy);

    let handle = config().unwrap().create().unwrap();
    let (sx, sl, sgu, sd) = (
        [L as i64, D as i64],
        [L as i64, E as i64],
        [E as i64, D as i64, 2 * H as i64],
        [E as i64, H as i64, D as i64],
    );
    let sk = [L as i64, K as i64];
    let se = [E as i64];
    let mut y = vec![0f32; L * D];
    let mut ids = vec![0i64; L * K];
    let mut gates = vec![0f32; L * K];
    let mut counts = vec![0i32; E];

    let mut saved = HostBuffer::new(handle.saved_size(L as i64).unwrap());
    let mut ws = HostBuffer::new(
        handle
            .workspace_size(Pass::FORWARD_TRAINING, L as i64)
            .unwrap(),
    );
    {
        let args = [
            Arg::new(ArgKind::INPUT, TensorRef::host(&x, &sx).unwrap()),
            Arg::new(
                ArgKind::ROUTER_LOGITS,
                TensorRef::host(&logits, &sl).unwrap(),
            ),
            Arg::new(ArgKind::W_GATE_UP, TensorRef::host(&wgu, &sgu).unwrap()),
            Arg::new(ArgKind::W_DOWN, TensorRef::host(&wd, &sd).unwrap()),
            Arg::new(ArgKind::OUTPUT, TensorRef::host_mut(&mut y, &sx).unwrap()),
            Arg::new(
                ArgKind::TOPK_INDICES,
                TensorRef::host_mut(&mut ids, &sk).unwrap(),
            ),
            Arg::new(
                ArgKind::TOPK_WEIGHTS,
                TensorRef::host_mut(&mut gates, &sk).unwrap(),
            ),
            Arg::new(
                ArgKind::TOKENS_PER_EXPERT,
                TensorRef::host_mut(&mut counts, &se).unwrap(),
            ),
        ];
        handle.check_args(Pass::FORWARD_TRAINING, &args).unwrap();
        // Too small a workspace is refused with a message, before anything is written.
        let mut small = HostBuffer::new(256);
        if ws.len() > 256 {
            let e = unsafe {
                handle.forward(
                    Pass::FORWARD_TRAINING,
                    &args,
                    small.as_mut_ptr(),
                    256,
                    saved.as_mut_ptr(),
                    saved.len(),
                    Stream::DEFAULT,
                )
            }
            .unwrap_err();
            assert_eq!(e.status, Status::InsufficientWorkspace);
            assert!(!e.message.is_empty());
        }
        // SAFETY: host slices borrowed by `args`; HostBuffers are 256-byte aligned and sized
        // from the queries; the CPU engine is synchronous.
        unsafe {
            handle
                .forward(
                    Pass::FORWARD_TRAINING,
                    &args,
                    ws.as_mut_ptr(),
                    ws.len(),
                    saved.as_mut_ptr(),
                    saved.len(),
                    Stream::DEFAULT,
                )
                .unwrap();
        }
    }
    assert_eq!(ids, r.ids);
    let e = rel_err(&y, &r.y);
    assert!(e < 1e-4, "y relative error {e}");
    assert_eq!(counts.iter().sum::<i32>() as usize, L * K);

    let mut dx = vec![0f32; L * D];
    let mut dwgu = vec![0f32; E * D * 2 * H];
    let mut dwd = vec![0f32; E * H * D];
    let mut dlogits = vec![0f32; L * E];
    let mut ws = HostBuffer::new(handle.workspace_size(Pass::BACKWARD, L as i64).unwrap());
    {
        let args = [
            Arg::new(ArgKind::INPUT, TensorRef::host(&x, &sx).unwrap()),
            Arg::new(
                ArgKind::ROUTER_LOGITS,
                TensorRef::host(&logits, &sl).unwrap(),
            ),
            Arg::new(ArgKind::W_GATE_UP, TensorRef::host(&wgu, &sgu).unwrap()),
            Arg::new(ArgKind::W_DOWN, TensorRef::host(&wd, &sd).unwrap()),
            Arg::new(ArgKind::GRAD_OUTPUT, TensorRef::host(&dy, &sx).unwrap()),
            Arg::new(
                ArgKind::GRAD_INPUT,
                TensorRef::host_mut(&mut dx, &sx).unwrap(),
            ),
            Arg::new(
                ArgKind::GRAD_W_GATE_UP,
                TensorRef::host_mut(&mut dwgu, &sgu).unwrap(),
            ),
            Arg::new(
                ArgKind::GRAD_W_DOWN,
                TensorRef::host_mut(&mut dwd, &sd).unwrap(),
            ),
            Arg::new(
                ArgKind::GRAD_ROUTER_LOGITS,
                TensorRef::host_mut(&mut dlogits, &sl).unwrap(),
            ),
        ];
        // SAFETY: as above; `saved` holds this handle's training forward for L tokens.
        unsafe {
            handle
                .backward(
                    &args,
                    saved.as_ptr(),
                    saved.len(),
                    ws.as_mut_ptr(),
                    ws.len(),
                    Stream::DEFAULT,
                )
                .unwrap();
        }
    }
    for (name, got, want) in [("dW_down", &dwd, &r.dwd), ("dW_gate_up", &dwgu, &r.dwgu)] {
        let e = rel_err(got, want);
        assert!(e < 1e-4, "{name} relative error {e}");
    }
    // dx here also holds the router path (d logits do not reach x when routing from logits).
    let e = rel_err(&dx, &r.dx);
    assert!(e < 1e-4, "dx relative error {e}");
    assert!(dlogits.iter().all(|v| v.is_finite()));
    // Softmax: each token's d logits sum to zero (no z-loss here).
    for t in 0..L {
        let s: f32 = dlogits[t * E..(t + 1) * E].iter().sum();
        assert!(s.abs() < 1e-5, "token {t}: sum of d logits {s}");
    }
}

#[test]
fn bad_arguments_are_reported() {
    let handle = config().unwrap().create().unwrap();
    let x = vec![0f32; L * D];
    let sx = [L as i64, D as i64];
    let args = [Arg::new(ArgKind::INPUT, TensorRef::host(&x, &sx).unwrap())];
    let e = handle
        .check_args(Pass::FORWARD_TRAINING, &args)
        .unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(!e.message.is_empty());
    let bad = [Arg::new(ArgKind(999), TensorRef::host(&x, &sx).unwrap())];
    assert_eq!(
        handle
            .check_args(Pass::FORWARD_TRAINING, &bad)
            .unwrap_err()
            .status,
        Status::InvalidArgument
    );
}
