"""Tests of the Python binding (stdlib unittest; run with ``python -m unittest discover``).

The library comes from MOEBLAZE_LIBRARY (set by CTest). The numeric tests compare the CPU
engine with a pure-Python fp64 reference written here from docs/design.md.
"""
import ctypes
import gc
import math
import os
import sys
import threading
import unittest
from array import array

_HERE = os.path.dirname(os.path.abspath(__file__))
# bindings/python, unless the installed package is under test (MOEBLAZE_TEST_INSTALLED=1: the
# pip-installed package with its own library, as scripts/test.sh checks it).
if os.environ.get("MOEBLAZE_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.dirname(_HERE))

import moeblaze  # noqa: E402
from moeblaze import (Activation, ArgKind, Attr, MoEBlazeError, Pass, Status,  # noqa: E402
                      _lib, _types)

_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))


# ------------------------------------------------------------------------------------------------
# Deterministic data and the fp64 reference (docs/design.md, "The math")
# ------------------------------------------------------------------------------------------------
class Rng:
    """A small LCG so that the test data is identical on every machine."""

    def __init__(self, seed):
        self.s = seed & 0xFFFFFFFFFFFFFFFF

    def uniform(self, lo=-1.0, hi=1.0):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return lo + (hi - lo) * ((self.s >> 11) / float(1 << 53))

    def floats(self, n, scale=1.0):
        # Values representable in f32, so the library and the reference see the same inputs.
        return array("f", [self.uniform() * scale for _ in range(n)])


def silu(v):
    return v / (1.0 + math.exp(-v))


def dsilu(v):
    s = 1.0 / (1.0 + math.exp(-v))
    return s * (1.0 + v * (1.0 - s))


def gelu(v):
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def dgelu(v):
    return 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) + v * math.exp(-0.5 * v * v) / math.sqrt(
        2.0 * math.pi)


def act_fwd(activation, pre, h):
    """act from the pre-activation row (length g*h; gate columns first)."""
    if activation == Activation.SWIGLU:
        return [silu(pre[i]) * pre[h + i] for i in range(h)]
    if activation == Activation.GEGLU:
        return [gelu(pre[i]) * pre[h + i] for i in range(h)]
    if activation == Activation.RELU:
        return [max(v, 0.0) for v in pre]
    if activation == Activation.GELU:
        return [gelu(v) for v in pre]
    return [silu(v) for v in pre]


def act_bwd(activation, pre, h, dact):
    """d pre-activation from d act."""
    if activation == Activation.SWIGLU:
        return ([dact[i] * pre[h + i] * dsilu(pre[i]) for i in range(h)]
                + [dact[i] * silu(pre[i]) for i in range(h)])
    if activation == Activation.GEGLU:
        return ([dact[i] * pre[h + i] * dgelu(pre[i]) for i in range(h)]
                + [dact[i] * gelu(pre[i]) for i in range(h)])
    if activation == Activation.RELU:
        return [dact[i] * (1.0 if pre[i] > 0 else 0.0) for i in range(h)]
    if activation == Activation.GELU:
        return [dact[i] * dgelu(pre[i]) for i in range(h)]
    return [dact[i] * dsilu(pre[i]) for i in range(h)]


def reference(p, x, logits, wgu, wd, dy, caller_ids=None, caller_gates=None,
              grad_aux=1.0, grad_z=1.0):
    """fp64 forward and backward of one layer. Routing from logits, or caller routing when
    caller_ids/caller_gates are given. Returns a dict of flat lists."""
    L, d, h, E, k, act = p["L"], p["d"], p["h"], p["E"], p["k"], p["activation"]
    g = 2 if act in (Activation.SWIGLU, Activation.GEGLU) else 1
    gh = g * h
    sig = p.get("score_fn", 0) == 1
    normalize = p.get("normalize", 0)
    ca, cz = p.get("aux", 0.0), p.get("z", 0.0)
    scores, ids, gates = [], [], []
    if caller_ids is None:
        for t in range(L):
            row = [logits[t * E + e] for e in range(E)]
            if sig:
                sc = [1.0 / (1.0 + math.exp(-v)) for v in row]
            else:
                m = max(row)
                ex = [math.exp(v - m) for v in row]
                s = sum(ex)
                sc = [v / s for v in ex]
            scores.append(sc)
            order = sorted(range(E), key=lambda e: (-sc[e], e))[:k]
            sel = [sc[e] for e in order]
            if normalize:
                s = sum(sel)
                sel = [v / s for v in sel]
            ids.append(order)
            gates.append(sel)
    else:
        ids = [[int(caller_ids[t * k + j]) for j in range(k)] for t in range(L)]
        gates = [[float(caller_gates[t * k + j]) for j in range(k)] for t in range(L)]

    def wgu_at(e, i, c):
        return wgu[(e * d + i) * gh + c]

    def wd_at(e, c, o):
        return wd[(e * h + c) * d + o]

    y = [0.0] * (L * d)
    dx = [0.0] * (L * d)
    dwgu = [0.0] * (E * d * gh)
    dwd = [0.0] * (E * h * d)
    dgate = [[0.0] * k for _ in range(L)]
    for t in range(L):
        xt = [x[t * d + i] for i in range(d)]
        dyt = [dy[t * d + o] for o in range(d)]
        for j in range(k):
            e, gt = ids[t][j], gates[t][j]
            pre = [sum(xt[i] * wgu_at(e, i, c) for i in range(d)) for c in range(gh)]
            a = act_fwd(act, pre, h)
            for o in range(d):
                y[t * d + o] += gt * sum(a[c] * wd_at(e, c, o) for c in range(h))
            dact = [sum(dyt[o] * wd_at(e, c, o) for o in range(d)) for c in range(h)]
            dgate[t][j] = sum(dact[c] * a[c] for c in range(h))
            for c in range(h):
                for o in range(d):
                    dwd[(e * h + c) * d + o] += a[c] * gt * dyt[o]
            dpre = act_bwd(act, pre, h, [gt * v for v in dact])
            for i in range(d):
                for c in range(gh):
                    dwgu[(e * d + i) * gh + c] += xt[i] * dpre[c]
                dx[t * d + i] += sum(dpre[c] * wgu_at(e, i, c) for c in range(gh))
    out = {"y": y, "dx": dx, "dw_gate_up": dwgu, "dw_down": dwd, "ids": ids, "gates": gates,
           "dgate": dgate}
    if caller_ids is not None:
        return out

    counts = [0] * E
    for t in range(L):
        for e in ids[t]:
            counts[e] += 1
    P = [sum(scores[t][e] for t in range(L)) / L for e in range(E)] if L else [0.0] * E
    f = [counts[e] / float(L * k) for e in range(E)] if L else [0.0] * E
    out["aux"] = ca * E * sum(f[e] * P[e] for e in range(E))
    lse = []
    for t in range(L):
        row = [logits[t * E + e] for e in range(E)]
        m = max(row)
        lse.append(m + math.log(sum(math.exp(v - m) for v in row)))
    out["z"] = cz * sum(v * v for v in lse) / L if L else 0.0
    out["counts"] = counts
    dlogits = [0.0] * (L * E)
    for t in range(L):
        dp = [0.0] * E
        sel = [scores[t][e] for e in ids[t]]
        if normalize:
            s = sum(sel)
            inner = sum(dgate[t][j] * gates[t][j] for j in range(k))
            for j, e in enumerate(ids[t]):
                dp[e] += (dgate[t][j] - inner) / s
        else:
            for j, e in enumerate(ids[t]):
                dp[e] += dgate[t][j]
        for e in range(E):
            dp[e] += grad_aux * ca * E * f[e] / L
        sc = scores[t]
        if sig:
            dl = [dp[e] * sc[e] * (1.0 - sc[e]) for e in range(E)]
        else:
            inner = sum(dp[e] * sc[e] for e in range(E))
            dl = [sc[e] * (dp[e] - inner) for e in range(E)]
        row = [logits[t * E + e] for e in range(E)]
        soft = [math.exp(v - lse[t]) for v in row]
        for e in range(E):
            dlogits[t * E + e] = dl[e] + grad_z * cz * 2.0 * lse[t] / L * soft[e]
    out["dlogits"] = dlogits
    return out


def rel_err(got, want):
    got = list(got)
    want = list(want)
    assert len(got) == len(want), (len(got), len(want))
    scale = max([abs(v) for v in want] + [1e-30])
    return max([abs(a - b) for a, b in zip(got, want)] + [0.0]) / scale


# ------------------------------------------------------------------------------------------------
class TestLoadAndVersion(unittest.TestCase):
    def test_version(self):
        self.assertEqual(moeblaze.get_abi_version(), _types.ABI_VERSION)
        self.assertEqual(moeblaze.get_version(), _types.VERSION)
        self.assertEqual(moeblaze.get_version_string(), "%d.%d.%d" % (
            _types.VERSION_MAJOR, _types.VERSION_MINOR, _types.VERSION_PATCH))
        self.assertIn(moeblaze.get_version_string(), moeblaze.get_build_info())

    def test_library_from_env(self):
        env = os.environ.get("MOEBLAZE_LIBRARY")
        if env:
            self.assertEqual(moeblaze.library_path, env)

    def test_every_function_declared(self):
        """argtypes/restype on every exported function; the list matches the ABI list."""
        path = os.path.join(_REPO, "tests", "abi", "exported-symbols.txt")
        if os.path.exists(path):
            with open(path) as fh:
                expected = sorted(l.strip() for l in fh if l.strip() and not l.startswith("#"))
        else:
            with open(os.path.join(_REPO, "src", "libmoeblaze.map")) as fh:
                text = fh.read()
            glob = text.split("global:")[1].split("local:")[0]
            expected = sorted(s.strip().rstrip(";") for s in glob.split() if s.strip(";"))
        self.assertEqual(list(_lib.DECLARED), expected)
        for name in _lib.DECLARED:
            fn = getattr(_lib.lib, name)
            self.assertIsNotNone(fn.argtypes, name)
            self.assertIsNotNone(fn.restype, name)

    def test_abi_mismatch_refused(self):
        """A library reporting ABI 1 is refused at import with a clear message."""
        import subprocess
        code = (
            "import ctypes\n"
            "class FakeFn:\n"
            "    argtypes = restype = None\n"
            "    def __call__(self):\n"
            "        return 1\n"
            "class FakeCDLL(ctypes.CDLL):\n"
            "    def __getattr__(self, name):\n"
            "        if name == 'moeblaze_get_abi_version':\n"
            "            self.__dict__[name] = FakeFn()\n"
            "            return self.__dict__[name]\n"
            "        return super().__getattr__(name)\n"
            "ctypes.CDLL = FakeCDLL\n"
            "try:\n"
            "    import moeblaze\n"
            "except Exception as e:\n"
            "    print('REFUSED', e.status_name, type(e).__name__, e.message)\n")
        env = dict(os.environ)
        if os.environ.get("MOEBLAZE_TEST_INSTALLED") != "1":
            env["PYTHONPATH"] = os.path.dirname(_HERE)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60)
        self.assertIn("REFUSED MOEBLAZE_STATUS_VERSION_MISMATCH", res.stdout, res.stderr)
        self.assertIn("reports ABI version 1", res.stdout)


class TestStatusAndTypes(unittest.TestCase):
    def test_status_names(self):
        for name, value in Status.members().items():
            self.assertEqual(moeblaze.status_name(value), "MOEBLAZE_STATUS_" + name)
            self.assertTrue(moeblaze.status_string(value))
        self.assertEqual(moeblaze.status_name(12345), "MOEBLAZE_STATUS_UNKNOWN")
        self.assertEqual(moeblaze.status_name(-1), "MOEBLAZE_STATUS_UNKNOWN")
        self.assertTrue(moeblaze.status_string(12345))
        self.assertEqual(Status.name(12345), "UNKNOWN(12345)")  # unknown values never crash

    def test_struct_sizes(self):
        self.assertEqual(ctypes.sizeof(_types.Tensor), 48)
        self.assertEqual(ctypes.sizeof(_types.Arg), 56)
        self.assertEqual(ctypes.sizeof(_types.Device), 8)
        self.assertEqual(ctypes.sizeof(_types.DType), 4)
        self.assertEqual(ctypes.sizeof(_types.AttrInfo), 64)
        self.assertEqual(_types.Tensor.ndim.offset, 16)
        self.assertEqual(_types.Tensor.dtype.offset, 20)
        self.assertEqual(_types.Tensor.shape.offset, 24)
        self.assertEqual(_types.Tensor.byte_offset.offset, 40)
        self.assertEqual(_types.Arg.tensor.offset, 8)

    def test_constants(self):
        self.assertEqual(moeblaze.MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, 102)
        self.assertEqual(moeblaze.MOEBLAZE_STATUS_INTERNAL_ERROR, 12)
        self.assertEqual(moeblaze.MOEBLAZE_DEVICE_CPU, 1)
        self.assertEqual(moeblaze.MOEBLAZE_ATTR_NUM_THREADS, 18)
        self.assertEqual(moeblaze.BUFFER_ALIGNMENT, 256)
        self.assertEqual(Activation.parse("swiglu"), 3)
        self.assertEqual(moeblaze.F32, moeblaze.dtype_from_name("f32"))

    def test_device_count(self):
        self.assertEqual(moeblaze.get_device_count("cpu"), 1)
        self.assertGreaterEqual(moeblaze.get_device_count("cuda"), 0)
        with self.assertRaises(MoEBlazeError) as cm:
            moeblaze.get_device_count(77)
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)


class TestAttributes(unittest.TestCase):
    def test_attr_query(self):
        attrs = moeblaze.attributes()
        self.assertGreaterEqual(len(attrs), _types.ATTR_COUNT)
        for name, value in Attr.members().items():
            spec = attrs[name.lower()]
            self.assertEqual(spec.number, value)
        self.assertTrue(attrs["top_k"].required)
        self.assertEqual(attrs["top_k"].value_type, _types.ValueType.I64)
        self.assertEqual(attrs["aux_loss_coeff"].value_type, _types.ValueType.F64)
        self.assertEqual(attrs["activation_dtype"].value_type, _types.ValueType.DTYPE)
        self.assertEqual(attrs["activation"].default_i64, Activation.SWIGLU)
        self.assertFalse(attrs["activation"].required)
        self.assertEqual(attrs["top_k"].since_version, _types.version_encode(0, 1, 0))

    def test_ep_transport_by_name(self):
        """EP_TRANSPORT takes its names as the other enum attributes do, with the header's values."""
        for name, value in (("auto", 0), ("nvlink", 1), ("host", 2), ("HOST", 2)):
            with moeblaze.Config(ep_transport=name) as cfg:
                self.assertEqual(cfg.get(Attr.EP_TRANSPORT), value)
        self.assertEqual(moeblaze.MOEBLAZE_EP_TRANSPORT_HOST, 2)
        with self.assertRaises((ValueError, MoEBlazeError, moeblaze.BindingError)):
            moeblaze.Config(ep_transport="infiniband")

    def test_unknown_attribute_raw(self):
        info = _types.AttrInfo()
        info.struct_size = ctypes.sizeof(info)
        with self.assertRaises(MoEBlazeError) as cm:
            _lib.lib.moeblaze_attr_query(100000, ctypes.byref(info))
        self.assertEqual(cm.exception.status, Status.UNKNOWN_ATTRIBUTE)
        self.assertEqual(cm.exception.function, "moeblaze_attr_query")
        info.struct_size = 4
        with self.assertRaises(MoEBlazeError) as cm:
            _lib.lib.moeblaze_attr_query(0, ctypes.byref(info))
        self.assertEqual(cm.exception.status, Status.VERSION_MISMATCH)

    def test_attr_query_older_struct(self):
        """A caller with a smaller (older) struct gets only the bytes it declared."""
        info = _types.AttrInfo()
        ctypes.memset(ctypes.addressof(info), 0xAB, ctypes.sizeof(info))
        info.struct_size = 16  # struct_size and name only
        _lib.lib.moeblaze_attr_query(Attr.TOP_K, ctypes.byref(info))
        self.assertEqual(info.name, b"top_k")
        raw = bytes((ctypes.c_char * ctypes.sizeof(info)).from_address(ctypes.addressof(info)))
        self.assertEqual(raw[16:], b"\xab" * (ctypes.sizeof(info) - 16))


def _cfg_kwargs(**over):
    kw = dict(num_experts=4, top_k=2, hidden_size=8, ffn_hidden_size=12, max_tokens=16,
              activation="swiglu", device_type="cpu", activation_dtype="f32",
              weight_dtype="f32", num_threads=2)
    kw.update(over)
    return kw


class TestConfigAndHandle(unittest.TestCase):
    def test_config_roundtrip(self):
        with moeblaze.Config(**_cfg_kwargs(aux_loss_coeff=0.01)) as cfg:
            self.assertEqual(cfg.get("top_k"), 2)
            self.assertEqual(cfg["num_experts"], 4)
            self.assertAlmostEqual(cfg.get("aux_loss_coeff"), 0.01)
            self.assertEqual(cfg.get("activation_dtype"), moeblaze.F32)
            self.assertEqual(cfg.get(Attr.ACTIVATION), Activation.SWIGLU)
            cfg["top_k"] = 3
            self.assertEqual(cfg.get("top_k"), 3)
        self.assertTrue(cfg.closed)
        cfg.close()  # idempotent
        with self.assertRaises(moeblaze.BindingError):
            cfg.get("top_k")

    def test_config_errors_carry_messages(self):
        with moeblaze.Config() as cfg:
            with self.assertRaises(MoEBlazeError) as cm:
                cfg.set("top_k", 0)
            e = cm.exception
            self.assertEqual(e.status, Status.INVALID_ARGUMENT)
            self.assertEqual(e.status_name, "MOEBLAZE_STATUS_INVALID_ARGUMENT")
            self.assertEqual(e.function, "moeblaze_config_set_i64")
            self.assertIn("top_k", e.message)
            self.assertIn("top_k", str(e))
            with self.assertRaises(MoEBlazeError) as cm:
                cfg.set("aux_loss_coeff", -1.0)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertTrue(cm.exception.message)
            with self.assertRaises(MoEBlazeError) as cm:  # i64 setter on an f64 attribute
                _lib.lib.moeblaze_config_set_i64(cfg, Attr.AUX_LOSS_COEFF, 1)
            self.assertEqual(cm.exception.status, Status.ATTRIBUTE_TYPE_MISMATCH)
            with self.assertRaises(MoEBlazeError) as cm:
                cfg.set(4242, 1)
            self.assertEqual(cm.exception.status, Status.UNKNOWN_ATTRIBUTE)
            with self.assertRaises(moeblaze.BindingError) as cm:
                cfg.set("no_such_attribute", 1)
            self.assertEqual(cm.exception.status, Status.UNKNOWN_ATTRIBUTE)
            with self.assertRaises(MoEBlazeError) as cm:
                cfg.set("activation_dtype", "i32")
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            with self.assertRaises(ValueError):
                cfg.set("activation", "tanh")
            self.assertTrue(moeblaze.last_error_message())  # the set_dtype failure above
            cfg.get("top_k")
            self.assertEqual(moeblaze.last_error_message(), "")  # cleared by a success

    def test_create_errors(self):
        with self.assertRaises(MoEBlazeError) as cm:
            moeblaze.Handle(device_type="cpu", num_experts=4)  # required attributes missing
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        self.assertEqual(cm.exception.function, "moeblaze_create")
        self.assertIn("required", cm.exception.message)
        with self.assertRaises(MoEBlazeError) as cm:
            moeblaze.Handle(**_cfg_kwargs(num_experts=2, top_k=3))
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        self.assertIn("top_k", cm.exception.message)

    def test_error_is_per_thread(self):
        seen = {}

        def worker():
            seen["msg"] = moeblaze.last_error_message()

        with moeblaze.Config() as cfg:
            with self.assertRaises(MoEBlazeError):
                cfg.set("top_k", -5)
            th = threading.Thread(target=worker)
            th.start()
            th.join()
        self.assertEqual(seen["msg"], "")

    def test_handle_queries(self):
        with moeblaze.Handle(**_cfg_kwargs()) as h:
            self.assertEqual(h.get("engine"), moeblaze.Engine.CPU)
            self.assertEqual(h.get("device_type"), moeblaze.DeviceType.CPU)
            self.assertEqual(h.get("top_k"), 2)
            prev = -1
            for L in (0, 1, 5, 16):
                ws = h.workspace_size(Pass.FORWARD_TRAINING, L)
                sv = h.saved_size(L)
                self.assertEqual(ws % 256, 0)
                self.assertEqual(sv % 256, 0)
                self.assertGreaterEqual(sv, prev)
                prev = sv
            with self.assertRaises(MoEBlazeError) as cm:
                h.workspace_size(Pass.FORWARD_TRAINING, 17)  # > max_tokens
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            with self.assertRaises(MoEBlazeError):
                h.workspace_size(99, 1)
        h.close()
        self.assertTrue(h.closed)

    def test_assert_status_on_cpu(self):
        from array import array
        with moeblaze.Handle(**_cfg_kwargs()) as h:
            st = array("i", [0])
            t = moeblaze.host_tensor(st, (), moeblaze.I32)
            for p in (Pass.FORWARD_TRAINING, Pass.BACKWARD, Pass.ROUTE):
                h.assert_status(p, t)
            st[0] = Status.INVALID_ARGUMENT
            with self.assertRaises(MoEBlazeError) as cm:
                h.assert_status(Pass.FORWARD_TRAINING, moeblaze.host_tensor(st, (), moeblaze.I32))
            self.assertIn("caller expert id", str(cm.exception))
            with self.assertRaises(MoEBlazeError) as cm:
                h.assert_status(Pass.BACKWARD, moeblaze.host_tensor(st, (), moeblaze.I32))
            self.assertIn("saved buffer", str(cm.exception))
            with self.assertRaises(TypeError):
                h.assert_status(Pass.BACKWARD, st)
            wide = array("q", [0])
            with self.assertRaises(MoEBlazeError):
                h.assert_status(Pass.BACKWARD, moeblaze.host_tensor(wide, (), moeblaze.I64))

    def test_finalizer_releases(self):
        h = moeblaze.Handle(**_cfg_kwargs())
        fin = h._finalizer
        del h
        gc.collect()
        self.assertFalse(fin.alive)

    def test_cyclic_garbage_does_not_clobber_messages(self):
        """A handle collected by the cyclic GC is destroyed later, not inside the collection,
        so it cannot clear another call's error message."""
        from moeblaze import _core
        h = moeblaze.Handle(**_cfg_kwargs())
        fin = h._finalizer
        h.cycle = h  # only the cyclic collector can free it
        del h
        gc.collect()
        self.assertFalse(fin.alive)
        self.assertEqual(len(_core._pending), 1)  # queued, not destroyed during the collection
        with moeblaze.Config() as cfg:  # the next binding call destroys it
            self.assertEqual(len(_core._pending), 0)
            with self.assertRaises(MoEBlazeError) as cm:
                cfg.set("top_k", 0)
            self.assertIn("top_k", cm.exception.message)

    def test_log_level_bounds(self):
        with self.assertRaises(MoEBlazeError) as cm:
            moeblaze.set_log_callback(lambda *a: None, 7)
        self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
        moeblaze.set_log_callback(None)

    def test_log_callback(self):
        got = []
        moeblaze.set_log_callback(lambda lvl, fn, msg: got.append((lvl, fn, msg)), 1)
        try:
            with moeblaze.Config() as cfg:
                with self.assertRaises(MoEBlazeError):
                    cfg.set("top_k", 0)
        finally:
            moeblaze.set_log_callback(None)
        self.assertTrue(any(lvl == moeblaze.LogLevel.ERROR and "top_k" in msg
                            for lvl, _, msg in got), got)


class TestAlignedBuffer(unittest.TestCase):
    def test_alignment(self):
        for n in (0, 1, 255, 256, 1000):
            b = moeblaze.AlignedBuffer(n)
            self.assertEqual(b.address % 256, 0)
            self.assertEqual(len(b.memoryview()), n)


# ------------------------------------------------------------------------------------------------
P = dict(L=5, d=8, h=12, E=4, k=2, activation=Activation.SWIGLU)


def _data(p, seed=1):
    r = Rng(seed)
    g = 2 if p["activation"] in (Activation.SWIGLU, Activation.GEGLU) else 1
    x = r.floats(p["L"] * p["d"])
    logits = r.floats(p["L"] * p["E"], 2.0)
    wgu = r.floats(p["E"] * p["d"] * g * p["h"], 0.5)
    wd = r.floats(p["E"] * p["h"] * p["d"], 0.5)
    dy = r.floats(p["L"] * p["d"])
    return x, logits, wgu, wd, dy


class TestCpuForwardBackward(unittest.TestCase):
    TOL = 1e-4

    def _layer(self, p, **over):
        kw = _cfg_kwargs(num_experts=p["E"], top_k=p["k"], hidden_size=p["d"],
                         ffn_hidden_size=p["h"], max_tokens=max(p["L"], 1),
                         activation=p["activation"])
        kw.update(over)
        return moeblaze.Layer(**kw)

    def _check(self, got, want, what):
        err = rel_err(got, want)
        self.assertLess(err, self.TOL, "%s: relative error %.3g" % (what, err))

    def _run_logits(self, p, **cfg):
        x, logits, wgu, wd, dy = _data(p)
        ref = reference(p, x, logits, wgu, wd, dy)
        with self._layer(p, **cfg) as layer:
            fwd = layer.forward(x, wgu, wd, router_logits=logits, aux_loss=True, z_loss=True)
            self._check(fwd.y, ref["y"], "y")
            self.assertEqual([list(fwd.topk_indices[t * p["k"]:(t + 1) * p["k"]])
                              for t in range(p["L"])], ref["ids"])
            self._check(fwd.topk_weights, [v for row in ref["gates"] for v in row], "gates")
            self.assertEqual(list(fwd.tokens_per_expert), ref["counts"])
            self.assertAlmostEqual(fwd.aux_loss, ref["aux"], delta=1e-5 + 1e-4 * abs(ref["aux"]))
            self.assertAlmostEqual(fwd.z_loss, ref["z"], delta=1e-5 + 1e-4 * abs(ref["z"]))
            grads = layer.backward(fwd, dy)
            self._check(grads.dx, ref["dx"], "dx")
            self._check(grads.dw_gate_up, ref["dw_gate_up"], "dW_gate_up")
            self._check(grads.dw_down, ref["dw_down"], "dW_down")
            self._check(grads.drouter_logits, ref["dlogits"], "d logits")
            return layer, fwd, grads

    def test_swiglu_softmax_from_logits(self):
        self._run_logits(dict(P))

    def test_swiglu_with_losses_and_normalize(self):
        p = dict(P, aux=0.01, z=0.001, normalize=1)
        self._run_logits(p, aux_loss_coeff=0.01, z_loss_coeff=0.001, normalize_topk=1)

    def test_sigmoid_gelu_recompute(self):
        p = dict(P, activation=Activation.GELU, score_fn=1, aux=0.02)
        self._run_logits(p, score_function="sigmoid", aux_loss_coeff=0.02,
                         save_policy="recompute_up")

    def test_router_weight_routing(self):
        """Case 2: logits = x W_g^T; dW_g = dlogits^T x and dx gains dlogits W_g."""
        p = dict(P, aux=0.01, z=0.002)
        x, _, wgu, wd, dy = _data(p, seed=3)
        L, d, E = p["L"], p["d"], p["E"]
        wg = Rng(11).floats(E * d, 0.5)
        logits = [sum(x[t * d + i] * wg[e * d + i] for i in range(d))
                  for t in range(L) for e in range(E)]
        ref = reference(p, x, logits, wgu, wd, dy)
        dl = ref["dlogits"]
        dwg = [sum(dl[t * E + e] * x[t * d + i] for t in range(L)) for e in range(E)
               for i in range(d)]
        dx = [ref["dx"][t * d + i] + sum(dl[t * E + e] * wg[e * d + i] for e in range(E))
              for t in range(L) for i in range(d)]
        with self._layer(p, aux_loss_coeff=0.01, z_loss_coeff=0.002) as layer:
            fwd = layer.forward(x, wgu, wd, router_weight=wg, aux_loss=True, z_loss=True)
            self._check(fwd.y, ref["y"], "y")
            self.assertAlmostEqual(fwd.aux_loss, ref["aux"], delta=1e-5 + 1e-4 * abs(ref["aux"]))
            self.assertAlmostEqual(fwd.z_loss, ref["z"], delta=1e-5 + 1e-4 * abs(ref["z"]))
            grads = layer.backward(fwd, dy, grad_aux_loss=1.0, grad_z_loss=1.0)
            self._check(grads.drouter_weight, dwg, "dW_g")
            self._check(grads.dx, dx, "dx (with the router path)")
            self._check(grads.dw_gate_up, ref["dw_gate_up"], "dW_gate_up")
            r = layer.route(x=x, router_weight=wg, aux_loss=True)
            self.assertEqual([list(r.topk_indices[t * 2:t * 2 + 2]) for t in range(L)],
                             ref["ids"])
            self.assertAlmostEqual(r.aux_loss, ref["aux"], delta=1e-5 + 1e-4 * abs(ref["aux"]))

    def test_loss_gradient_scales(self):
        """GRAD_AUX_LOSS / GRAD_Z_LOSS scale the loss terms of d logits (0 removes them)."""
        p = dict(P, aux=0.05, z=0.01)
        x, logits, wgu, wd, dy = _data(p, seed=5)
        ref = reference(p, x, logits, wgu, wd, dy, grad_aux=0.0, grad_z=3.0)
        with self._layer(p, aux_loss_coeff=0.05, z_loss_coeff=0.01) as layer:
            fwd = layer.forward(x, wgu, wd, router_logits=logits)
            grads = layer.backward(fwd, dy, grad_aux_loss=0.0, grad_z_loss=3.0,
                                   want=("router",))
            self._check(grads.drouter_logits, ref["dlogits"], "d logits")
            self.assertIsNone(grads.dx)

    def test_strides_and_byte_offset(self):
        x, logits, wgu, wd, _ = _data(P)
        with self._layer(P) as layer:
            h = layer.handle
            base = layer.forward(x, wgu, wd, router_logits=logits, training=False)
            padded = array("f", [0.0] * (5 * 11 + 3))
            for t in range(5):
                for i in range(8):
                    padded[3 + t * 11 + i] = x[t * 8 + i]
            xt = moeblaze.host_tensor(padded, (5, 8), strides=(11, 1))
            xt.byte_offset = 12
            y = array("f", bytes(4 * 40))
            args = moeblaze.ArgList([
                (ArgKind.INPUT, xt),
                (ArgKind.ROUTER_LOGITS, moeblaze.host_tensor(logits, (5, 4))),
                (ArgKind.W_GATE_UP, moeblaze.host_tensor(wgu, (4, 8, 24))),
                (ArgKind.W_DOWN, moeblaze.host_tensor(wd, (4, 12, 8))),
                (ArgKind.OUTPUT, moeblaze.host_tensor(y, (5, 8), writable=True)),
            ])
            ws = moeblaze.AlignedBuffer(h.workspace_size(Pass.FORWARD_INFERENCE, 5))
            h.forward(Pass.FORWARD_INFERENCE, args, ws)
            self.assertEqual(list(y), list(base.y))
            overlapping = moeblaze.host_tensor(padded, (5, 8), strides=(4, 1))
            bad = moeblaze.ArgList([(ArgKind.INPUT, overlapping)] + list(args)[1:])
            with self.assertRaises(MoEBlazeError) as cm:
                h.forward(Pass.FORWARD_INFERENCE, bad, ws)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("INPUT", cm.exception.message)

    def test_inference_matches_training(self):
        x, logits, wgu, wd, _ = _data(P)
        with self._layer(P) as layer:
            a = layer.forward(x, wgu, wd, router_logits=logits)
            b = layer.forward(x, wgu, wd, router_logits=logits, training=False)
            self.assertEqual(list(a.y), list(b.y))
            self.assertIsNone(b.saved)

    def test_caller_routing(self):
        p = dict(P)
        x, logits, wgu, wd, dy = _data(p, seed=7)
        ids = array("q", [0, 3, 1, 2, 3, 1, 2, 0, 1, 3])
        gates = array("f", [0.7, 0.3, 0.5, 0.5, 0.9, 0.1, 0.25, 0.75, 0.6, 0.4])
        ref = reference(p, x, None, wgu, wd, dy, ids, gates)
        with self._layer(p) as layer:
            fwd = layer.forward(x, wgu, wd, topk_indices=ids, topk_weights=gates)
            self._check(fwd.y, ref["y"], "y")
            grads = layer.backward(fwd, dy)
            self._check(grads.dx, ref["dx"], "dx")
            self._check(grads.dw_gate_up, ref["dw_gate_up"], "dW_gate_up")
            self._check(grads.dw_down, ref["dw_down"], "dW_down")
            self._check(grads.dtopk_weights, [v for row in ref["dgate"] for v in row], "d gates")
            bad = array("q", ids)
            bad[3] = 4  # out of range
            with self.assertRaises(MoEBlazeError) as cm:
                layer.forward(x, wgu, wd, topk_indices=bad, topk_weights=gates)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertTrue(cm.exception.message)
            bad[3] = 1  # duplicate of slot 0 of token 1? token 1 is (1, 2): make (1, 1)
            bad[2] = 1
            with self.assertRaises(MoEBlazeError) as cm:
                layer.forward(x, wgu, wd, topk_indices=bad, topk_weights=gates)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)

    def test_accumulate(self):
        x, logits, wgu, wd, dy = _data(P)
        with self._layer(P) as layer:
            fwd = layer.forward(x, wgu, wd, router_logits=logits)
            g1 = layer.backward(fwd, dy, want=("w_down",))
            acc = array("f", g1.dw_down)
            layer.backward(fwd, dy, want=("w_down",), out={"w_down": acc}, accumulate=True)
            self._check(acc, [2.0 * v for v in g1.dw_down], "accumulated dW_down")

    def test_last_use(self):
        """backward(last_use=True): the same gradients as a plain backward, then the forward is
        spent: a second backward of it is refused with the reason."""
        x, logits, wgu, wd, dy = _data(P)
        with self._layer(P) as layer:
            fwd = layer.forward(x, wgu, wd, router_logits=logits)
            plain = layer.backward(fwd, dy)
            last = layer.backward(fwd, dy, last_use=True)
            for name in ("dx", "dw_gate_up", "dw_down", "drouter_logits"):
                self.assertEqual(list(getattr(plain, name)), list(getattr(last, name)), name)
            with self.assertRaises(MoEBlazeError) as cm:
                layer.backward(fwd, dy)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertIn("spent", str(cm.exception))

    def test_route(self):
        x, logits, _, _, _ = _data(P)
        ref = reference(P, x, logits, [0.0] * (P["E"] * P["d"] * 2 * P["h"]),
                        [0.0] * (P["E"] * P["h"] * P["d"]), [0.0] * (P["L"] * P["d"]))
        with self._layer(P) as layer:
            r = layer.route(router_logits=logits, num_tokens=P["L"])
            self.assertEqual([list(r.topk_indices[t * 2:t * 2 + 2]) for t in range(P["L"])],
                             ref["ids"])
            self.assertEqual(list(r.tokens_per_expert), ref["counts"])

    def test_zero_tokens(self):
        with self._layer(P) as layer:
            x, logits, wgu, wd, dy = _data(P)
            fwd = layer.forward(array("f"), wgu, wd, router_logits=array("f"))
            self.assertEqual(len(fwd.y), 0)
            self.assertEqual(list(fwd.tokens_per_expert), [0] * P["E"])
            grads = layer.backward(fwd, array("f"))
            self.assertEqual(list(grads.dw_down), [0.0] * len(grads.dw_down))

    def test_insufficient_workspace(self):
        x, logits, wgu, wd, _ = _data(P)
        with self._layer(P) as layer:
            h = layer.handle
            L = P["L"]
            args = moeblaze.ArgList()
            args.add(ArgKind.INPUT, moeblaze.host_tensor(x, (L, 8)))
            args.add(ArgKind.ROUTER_LOGITS, moeblaze.host_tensor(logits, (L, 4)))
            args.add(ArgKind.W_GATE_UP, moeblaze.host_tensor(wgu, (4, 8, 24)))
            args.add(ArgKind.W_DOWN, moeblaze.host_tensor(wd, (4, 12, 8)))
            y = array("f", bytes(4 * L * 8))
            args.add(ArgKind.OUTPUT, moeblaze.host_tensor(y, (L, 8), writable=True))
            h.check_args(Pass.FORWARD_TRAINING, args)
            need = h.workspace_size(Pass.FORWARD_TRAINING, L)
            saved = moeblaze.AlignedBuffer(h.saved_size(L))
            if need > 256:
                with self.assertRaises(MoEBlazeError) as cm:
                    h.forward(Pass.FORWARD_TRAINING, args, moeblaze.AlignedBuffer(need - 256),
                              saved)
                self.assertEqual(cm.exception.status, Status.INSUFFICIENT_WORKSPACE)
            ws = moeblaze.AlignedBuffer(need + 256)
            with self.assertRaises(MoEBlazeError) as cm:  # misaligned workspace
                h.forward(Pass.FORWARD_TRAINING, args, ws.address + 8, saved,
                          workspace_bytes=need)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            h.forward(Pass.FORWARD_TRAINING, args, moeblaze.AlignedBuffer(need), saved)

    def test_bad_args(self):
        x, logits, wgu, wd, _ = _data(P)
        with self._layer(P) as layer:
            h = layer.handle
            args = moeblaze.ArgList()
            args.add(ArgKind.INPUT, moeblaze.host_tensor(x, (5, 8)))
            with self.assertRaises(MoEBlazeError) as cm:  # no weights, no output
                h.check_args(Pass.FORWARD_TRAINING, args)
            self.assertEqual(cm.exception.status, Status.INVALID_ARGUMENT)
            self.assertEqual(cm.exception.function, "moeblaze_check_args")
            self.assertTrue(cm.exception.message)
            with self.assertRaises(moeblaze.BindingError):  # buffer too small for the shape
                moeblaze.host_tensor(x, (6, 8))

    def test_buffer_kinds(self):
        """bytearray / memoryview / ctypes arrays work as well as array('f')."""
        x, logits, wgu, wd, _ = _data(P)
        with self._layer(P) as layer:
            base = layer.forward(x, wgu, wd, router_logits=logits, want_routing=False)
            xb = bytearray(x.tobytes())
            wgu_c = (ctypes.c_float * len(wgu))(*wgu)
            other = layer.forward(xb, memoryview(wgu_c), bytes(wd.tobytes()),
                                  router_logits=memoryview(logits), want_routing=False)
            self.assertEqual(list(base.y), list(other.y))


class TestDLPack(unittest.TestCase):
    """A pure-ctypes DLPack producer exercises moeblaze.dlpack without numpy."""

    def test_dlpack_forward(self):
        from moeblaze import dlpack
        x, logits, wgu, wd, _ = _data(P)
        ref = reference(P, x, logits, wgu, wd, [0.0] * len(x))
        deleted = []
        producers = [dlpack.HostDLPackArray(buf, shape, on_delete=deleted.append)
                     for buf, shape in ((x, (5, 8)), (logits, (5, 4)), (wgu, (4, 8, 24)),
                                        (wd, (4, 12, 8)))]
        y = array("f", bytes(4 * 5 * 8))
        with TestCpuForwardBackward()._layer(P) as layer:
            h = layer.handle
            with dlpack.ArgBuilder() as ab:
                for kind, prod in zip((ArgKind.INPUT, ArgKind.ROUTER_LOGITS, ArgKind.W_GATE_UP,
                                       ArgKind.W_DOWN), producers):
                    ab.add(kind, prod)
                ab.add(ArgKind.OUTPUT, dlpack.HostDLPackArray(y, (5, 8), on_delete=deleted.append))
                with self.assertRaises(moeblaze.BindingError):  # read-only output refused
                    ab.add(ArgKind.OUTPUT, dlpack.HostDLPackArray(y, (5, 8), read_only=True))
                ws = moeblaze.AlignedBuffer(h.workspace_size(Pass.FORWARD_INFERENCE, 5))
                h.forward(Pass.FORWARD_INFERENCE, ab.args, ws)
        self.assertLess(rel_err(y, ref["y"]), 1e-4)
        self.assertEqual(len(deleted), 5)  # every capsule was consumed and its deleter called


    def test_immutable_producer_refused_as_output(self):
        """A JAX array is immutable: refused as an output before its capsule is taken, even
        when its capsule would not say read-only; accepted as an input."""
        from moeblaze import dlpack
        deleted = []
        buf = array("f", [0.0] * 40)

        class FakeJaxArray(dlpack.HostDLPackArray):
            pass
        FakeJaxArray.__module__ = "jaxlib.xla_extension"
        prod = FakeJaxArray(buf, (5, 8), on_delete=deleted.append)
        with dlpack.ArgBuilder() as ab:
            with self.assertRaises(moeblaze.BindingError) as ctx:
                ab.add(ArgKind.OUTPUT, prod)
            self.assertIn("immutable", str(ctx.exception))
            self.assertEqual(deleted, [])  # the capsule was never taken
            ab.add(ArgKind.INPUT, prod)     # an input is fine
        self.assertEqual(len(deleted), 1)

    def test_unversioned_capsule(self):
        from moeblaze import dlpack
        deleted = []
        buf = array("f", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        prod = dlpack.HostDLPackArray(buf, (2, 3), on_delete=deleted.append)
        imp = dlpack.import_dlpack(prod, max_version=None)
        self.assertFalse(imp.versioned)
        self.assertEqual(imp.tensor.shape_tuple(), (2, 3))
        self.assertEqual(imp.tensor.dtype, moeblaze.F32)
        self.assertEqual(imp.tensor.data, buf.buffer_info()[0])
        imp.release()
        imp.release()  # once only
        self.assertEqual(len(deleted), 1)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


class TestTorch(unittest.TestCase):
    """moeblaze.torch; the CPU test needs torch only, the CUDA test torch with CUDA and a CUDA
    build of the library."""

    def _run(self, device, tol):
        torch = _torch()
        from moeblaze.torch import MoE
        p = dict(P, aux=0.01, z=0.002)
        x, logits, wgu, wd, dy = _data(p)
        ref = reference(p, x, logits, wgu, wd, dy)
        dev = torch.device(device)

        def t(a, shape):
            return torch.tensor(list(a), dtype=torch.float32, device=dev).reshape(shape)

        xt = t(x, (5, 8)).requires_grad_()
        lt = t(logits, (5, 4)).requires_grad_()
        wgut = t(wgu, (4, 8, 24)).requires_grad_()
        wdt = t(wd, (4, 12, 8)).requires_grad_()
        moe = MoE(num_experts=4, top_k=2, hidden_size=8, ffn_hidden_size=12, max_tokens=16,
                  activation="swiglu", activation_dtype="f32", weight_dtype="f32",
                  aux_loss_coeff=0.01, z_loss_coeff=0.002)
        y, aux, z, ids, gates, counts = moe(xt, wgut, wdt, router_logits=lt, return_all=True)
        loss = (y * t(dy, (5, 8))).sum() + aux + z
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        flat = lambda v: v.detach().cpu().flatten().tolist()  # noqa: E731
        self.assertLess(rel_err(flat(y), ref["y"]), tol)
        self.assertAlmostEqual(aux.item(), ref["aux"], delta=1e-5 + tol * abs(ref["aux"]))
        self.assertAlmostEqual(z.item(), ref["z"], delta=1e-5 + tol * abs(ref["z"]))
        self.assertEqual([flat(ids)[i:i + 2] for i in range(0, 10, 2)], ref["ids"])
        self.assertEqual(flat(counts), ref["counts"])
        self.assertLess(rel_err(flat(xt.grad), ref["dx"]), tol)
        self.assertLess(rel_err(flat(lt.grad), ref["dlogits"]), tol)
        self.assertLess(rel_err(flat(wgut.grad), ref["dw_gate_up"]), tol)
        self.assertLess(rel_err(flat(wdt.grad), ref["dw_down"]), tol)
        # Unused loss outputs contribute nothing (their gradient is 0, not the C default 1).
        for g in (xt, lt, wgut, wdt):
            g.grad = None
        y2 = moe(xt, wgut, wdt, router_logits=lt)
        (y2 * t(dy, (5, 8))).sum().backward()
        ref0 = reference(p, x, logits, wgu, wd, dy, grad_aux=0.0, grad_z=0.0)
        self.assertLess(rel_err(flat(lt.grad), ref0["dlogits"]), tol)
        moe.close()

    def test_autograd_cpu(self):
        if _torch() is None:
            self.skipTest("torch is not installed")
        self._run("cpu", 1e-4)

    def test_autograd_cuda(self):
        torch = _torch()
        if torch is None:
            self.skipTest("torch is not installed")
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        self._run("cuda", 1e-3)


class TestTorchOps(unittest.TestCase):
    """The torch.library operators on the CPU engine: torch.compile(fullgraph=True) traces a
    step without a graph break and matches eager bitwise; the saved buffer is a tensor that
    saved-tensor hooks see; inputs of any leading shape; opcheck's schema and fake-tensor
    checks; a bad saved tensor is an exception naming it."""

    def setUp(self):
        self.torch = _torch()
        if self.torch is None:
            self.skipTest("torch is not installed")
        from moeblaze.torch import MoE
        torch = self.torch
        p = dict(P, aux=0.01, z=0.002)
        self.p = p
        x, logits, wgu, wd, dy = _data(p)
        self.ref = reference(p, x, logits, wgu, wd, dy)

        def t(a, shape):
            return torch.tensor(list(a), dtype=torch.float32).reshape(shape)
        self.x, self.logits = t(x, (5, 8)), t(logits, (5, 4))
        self.wgu, self.wd, self.dy = t(wgu, (4, 8, 24)), t(wd, (4, 12, 8)), t(dy, (5, 8))
        self.moe = MoE(num_experts=4, top_k=2, hidden_size=8, ffn_hidden_size=12, max_tokens=16,
                       activation="swiglu", activation_dtype="f32", weight_dtype="f32",
                       aux_loss_coeff=0.01, z_loss_coeff=0.002)

    def tearDown(self):
        if getattr(self, "moe", None) is not None:
            self.moe.close()

    def _step(self, fn):
        leaves = [v.clone().requires_grad_() for v in (self.x, self.logits, self.wgu, self.wd)]
        y, aux, z = fn(*leaves)
        loss = (y * self.dy).sum() + aux + z
        loss.backward()
        return [y.detach(), aux.detach(), z.detach()] + [v.grad for v in leaves]

    def _layer(self, x, logits, wgu, wd):
        y, aux, z = self.moe(x, wgu, wd, router_logits=logits, return_all=True)[:3]
        return y, aux, z

    def test_linear_layout_weights_without_copy(self):
        """Weights stored nn.Linear-style ([E, 2h, d], [E, d, h]) and passed as their
        transpose(1, 2) views: the op reads them in place and writes their gradients in the
        same layout (the library reads strides; nothing is copied), matching the reference."""
        torch = self.torch
        from moeblaze._torch_ops import _weight_layout
        wgu_t = self.wgu.transpose(1, 2).contiguous().transpose(1, 2)  # [E, d, 2h] view of [E, 2h, d]
        wd_t = self.wd.transpose(1, 2).contiguous().transpose(1, 2)
        self.assertIs(_weight_layout(wgu_t), wgu_t)
        self.assertIs(_weight_layout(wd_t), wd_t)
        odd = torch.randn(4, 24, 16)[:, :, ::2]  # no unit stride: copied to row-major
        self.assertTrue(_weight_layout(odd).is_contiguous())
        leaves = [v.clone().requires_grad_() for v in (self.x, self.logits)]
        wgu = wgu_t.detach().requires_grad_()
        wd = wd_t.detach().requires_grad_()
        y, aux, z = self._layer(leaves[0], leaves[1], wgu, wd)
        ((y * self.dy).sum() + aux + z).backward()
        self.assertEqual(wgu.grad.stride(), wgu.stride())
        self.assertEqual(wd.grad.stride(), wd.stride())
        got = [y.detach(), aux.detach(), z.detach(), leaves[0].grad, leaves[1].grad, wgu.grad, wd.grad]
        want = self._step(self._layer)
        for a, b in zip(got, want):
            self.assertLess((a - b).abs().max().item(), 1e-5 * max(1.0, b.abs().max().item()))
        # with torch.compile (fullgraph): the fake kernels give the gradients the same strides
        compiled = torch.compile(self._layer, fullgraph=True, backend="aot_eager")
        wgu2, wd2 = wgu_t.detach().requires_grad_(), wd_t.detach().requires_grad_()
        y2, aux2, z2 = compiled(self.x, self.logits, wgu2, wd2)
        ((y2 * self.dy).sum() + aux2 + z2).backward()
        self.assertTrue(torch.equal(y2, got[0]))
        self.assertTrue(torch.equal(wgu2.grad, wgu.grad))
        self.assertEqual(wgu2.grad.stride(), wgu.stride())

    def test_compile_fullgraph_matches_eager(self):
        torch = self.torch
        eager = self._step(self._layer)
        flat = lambda v: v.flatten().tolist()  # noqa: E731
        self.assertLess(rel_err(flat(eager[0]), self.ref["y"]), 1e-4)
        self.assertLess(rel_err(flat(eager[3]), self.ref["dx"]), 1e-4)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(self._layer, fullgraph=True, backend=backend)
            got = self._step(compiled)
            for a, b in zip(got, eager):
                self.assertTrue(torch.equal(a, b), backend)

    def test_saved_buffer_is_an_autograd_saved_tensor(self):
        torch = self.torch
        packed = []

        def pack(t):
            packed.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = self._step(self._layer)
        saved = [shape for dtype, shape in packed if dtype == torch.uint8]
        handle = self.moe.handle_for(torch.device("cpu"))
        self.assertEqual(saved, [(handle.saved_size(5),)])
        with torch.autograd.graph.save_on_cpu():  # offload (a no-op copy on the CPU) still works
            again = self._step(self._layer)
        for a, b in zip(got, again):
            self.assertTrue(torch.equal(a, b))

    def test_backward_is_the_saved_buffers_last_use(self):
        """A backward that does not retain the graph is the saved buffer's last use (the
        operator calls moeblaze_backward_last_use); with retain_graph=True it only reads it, and
        the next backward, which frees the graph, is the last use. Every backward gives the
        plain step's gradients."""
        torch = self.torch
        from unittest import mock
        from moeblaze._core import Handle
        want = self._step(self._layer)
        seen = []
        plain_backward = Handle.backward

        def spy(handle, *args, **kwargs):
            seen.append(kwargs.get("last_use", False))
            return plain_backward(handle, *args, **kwargs)

        with mock.patch.object(Handle, "backward", spy):
            for retain in (False, True):
                leaves = [v.clone().requires_grad_() for v in (self.x, self.logits, self.wgu, self.wd)]
                y, aux, z = self._layer(*leaves)
                loss = (y * self.dy).sum() + aux + z
                loss.backward(retain_graph=retain)
                for a, b in zip([v.grad for v in leaves], want[3:]):
                    self.assertTrue(torch.equal(a, b))
                if retain:
                    for v in leaves:
                        v.grad = None
                    loss.backward()
                    for a, b in zip([v.grad for v in leaves], want[3:]):
                        self.assertTrue(torch.equal(a, b))
        self.assertEqual(seen, [True, False, True])

    def test_leading_dimensions(self):
        torch = self.torch
        x3 = self.x.reshape(5, 1, 8)
        y3 = self.moe(x3, self.wgu, self.wd, router_logits=self.logits)
        y2 = self.moe(self.x, self.wgu, self.wd, router_logits=self.logits)
        self.assertEqual(tuple(y3.shape), (5, 1, 8))
        self.assertTrue(torch.equal(y3.reshape(5, 8), y2))

    def test_opcheck(self):
        torch = self.torch
        from moeblaze.torch import LayerSpec  # noqa: F401
        args = (self.moe.spec.id, 1, self.x, self.logits, None, None, self.wgu.requires_grad_(),
                self.wd)
        torch.library.opcheck(torch.ops.moeblaze.moe_forward.default, args,
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))

    def test_handle_interface_runs_the_operators(self):
        """0.1's moe(handle, ...) / MoEFunction.apply over a caller's Handle: same results as
        MoE, through the same operators (the handle stays the caller's)."""
        torch = self.torch
        from moeblaze.torch import MoEFunction, moe
        with moeblaze.Config(**self.moe.spec.attrs) as cfg:
            cfg.set(Attr.DEVICE_TYPE, moeblaze.DeviceType.CPU)
            handle = moeblaze.Handle(cfg)
        want = self._step(self._layer)
        got = self._step(lambda x, lg, wgu, wd: moe(handle, x, wgu, wd, router_logits=lg)[:3])
        for a, b in zip(got, want):
            self.assertTrue(torch.equal(a, b))
        y = MoEFunction.apply(handle, 1, self.x, self.logits, None, None, self.wgu, self.wd)[0]
        self.assertTrue(torch.equal(y, want[0]))
        handle.close()

    def test_bad_arguments_are_named(self):
        """Wrong dtype, wrong device, ids out of range, a closed layer: a Python exception that
        names the argument or carries the library's message; the caller's tensors unchanged."""
        torch = self.torch
        from moeblaze.torch import MoE
        wd_before = self.wd.clone()
        with self.assertRaises(TypeError) as ctx:
            self.moe(self.x, self.wgu, self.wd.double(), router_logits=self.logits)
        self.assertIn("w_down", str(ctx.exception))
        with self.assertRaises(ValueError) as ctx:
            self.moe(self.x, self.wgu.to("meta"), self.wd, router_logits=self.logits)
        self.assertIn("w_gate_up", str(ctx.exception))
        ids = torch.tensor([[0, 1], [2, 4], [1, 3], [0, 2], [3, 1]], dtype=torch.int64)  # 4 >= E
        gates = torch.full((5, 2), 0.5)
        with self.assertRaises(MoEBlazeError) as ctx:
            self.moe(self.x, self.wgu, self.wd, topk_indices=ids, topk_weights=gates)
        self.assertIn("TOPK_INDICES", str(ctx.exception).upper())
        self.assertTrue(torch.equal(self.wd, wd_before))
        closed = MoE(**self.moe.spec.attrs)
        closed.close()
        with self.assertRaises(ValueError) as ctx:
            closed(self.x, self.wgu, self.wd, router_logits=self.logits)
        self.assertIn("closed", str(ctx.exception))

    def test_bad_saved_tensor_raises(self):
        torch = self.torch
        out = torch.ops.moeblaze.moe_forward(self.moe.spec.id, 1, self.x, self.logits, None, None,
                                             self.wgu, self.wd)
        with self.assertRaises(ValueError) as ctx:
            torch.ops.moeblaze.moe_backward(self.moe.spec.id, 1, self.x, self.logits, None, None,
                                            self.wgu, self.wd, out[6][:-1], self.dy,
                                            torch.zeros(()), torch.zeros(()),
                                            [True, False, False, False, False])
        self.assertIn("saved", str(ctx.exception))


def _hf_blocks(torch, d, h, E, k, names, renormalise):
    """A Hugging Face-style sparse MoE block in plain PyTorch (router nn.Linear, softmax, top-k,
    optional renormalisation, per-expert SwiGLU nn.Linear experts): the reference the
    converters are checked against."""
    import torch.nn as nn
    import torch.nn.functional as F
    gate_n, up_n, down_n = names

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            setattr(self, gate_n, nn.Linear(d, h, bias=False))
            setattr(self, up_n, nn.Linear(d, h, bias=False))
            setattr(self, down_n, nn.Linear(h, d, bias=False))

        def forward(self, x):
            return getattr(self, down_n)(F.silu(getattr(self, gate_n)(x)) * getattr(self, up_n)(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, E, bias=False)
            self.experts = nn.ModuleList([Expert() for _ in range(E)])
            self.top_k = k
            self.norm_topk_prob = renormalise

        def forward(self, x):
            p = F.softmax(self.gate(x), dim=-1)
            w, i = p.topk(k, dim=-1)
            if renormalise:
                w = w / w.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for j in range(k):
                for e in range(E):
                    m = i[:, j] == e
                    if m.any():
                        y = y.index_add(0, m.nonzero()[:, 0], w[m, j:j + 1] * self.experts[e](x[m]))
            return y
    return Block()


class TestTorchModule(unittest.TestCase):
    """moeblaze.torch.MoELayer: parameters, the Mixtral and Qwen3-MoE converters against those
    blocks in plain PyTorch (outputs and every gradient), a weight round trip, torch.compile
    fullgraph over a training step, and bad input as exceptions."""

    def setUp(self):
        self.torch = _torch()
        if self.torch is None:
            self.skipTest("torch is not installed")
        self.torch.manual_seed(0)

    def _compare(self, make_layer, names, renormalise):
        torch = self.torch
        d, h, E, k = 16, 24, 6, 2
        block = _hf_blocks(torch, d, h, E, k, names, renormalise)
        layer = make_layer(block)
        x = torch.randn(3, 13, d)
        xr, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref = block(xr.reshape(-1, d)).reshape(3, 13, d)
        y, aux, z = layer(xl)
        self.assertEqual(tuple(y.shape), (3, 13, d))
        self.assertLess((y - ref).abs().max().item(), 1e-5)
        dy = torch.randn_like(ref)
        (ref * dy).sum().backward()
        (y * dy).sum().backward()
        tol = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)  # noqa: E731
        self.assertLess(tol(xl.grad, xr.grad), 1e-4)
        self.assertLess(tol(layer.router_weight.grad, block.gate.weight.grad), 1e-4)
        for e, ex in enumerate(block.experts):
            self.assertLess(tol(layer.w_gate_up.grad[e, :, :h].t(), getattr(ex, names[0]).weight.grad), 1e-4)
            self.assertLess(tol(layer.w_gate_up.grad[e, :, h:].t(), getattr(ex, names[1]).weight.grad), 1e-4)
            self.assertLess(tol(layer.w_down.grad[e].t(), getattr(ex, names[2]).weight.grad), 1e-4)
        return block, layer

    def test_mixtral(self):
        from moeblaze.torch import MoELayer
        self._compare(lambda b: MoELayer.from_mixtral(b, max_tokens=64), ("w1", "w3", "w2"), True)

    def test_mixtral_balance_loss_is_transformers(self):
        """The converters' balance loss is transformers' load_balancing_loss_func times the
        coefficient (AUX_LOSS_FORM = HUGGING_FACE), value and router gradient."""
        torch = self.torch
        try:
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
        except ImportError:
            self.skipTest("transformers is not installed")
        from moeblaze.torch import MoELayer
        d, h, E, k, coef = 16, 24, 6, 2, 0.02
        block = _hf_blocks(torch, d, h, E, k, ("w1", "w3", "w2"), True)
        layer = MoELayer.from_mixtral(block, max_tokens=64, aux_loss_coeff=coef)
        x = torch.randn(39, d)
        aux = layer(x)[1]
        aux.backward()
        w = block.gate.weight.detach().clone().requires_grad_()
        want = coef * load_balancing_loss_func((x @ w.t(),), E, k)
        want.backward()
        self.assertLess(abs(aux.item() - want.item()) / want.item(), 1e-5)
        # transformers' loss also differentiates through the picks' one-hot counts (zero) and
        # through the mean scores: the same gradient
        err = (layer.router_weight.grad - w.grad).norm() / w.grad.norm()
        self.assertLess(err.item(), 1e-4)

    def test_qwen3_moe_without_renormalisation(self):
        from moeblaze.torch import MoELayer
        names = ("gate_proj", "up_proj", "down_proj")
        block, layer = self._compare(lambda b: MoELayer.from_qwen3_moe(b, max_tokens=64), names,
                                     False)
        # Round trip: the layer's weights written back into a fresh block reproduce it.
        other = _hf_blocks(self.torch, 16, 24, 6, 2, names, False)
        layer.store_linear_experts(other.gate, other.experts)
        x = self.torch.randn(10, 16)
        self.assertTrue(self.torch.equal(other(x), block(x)))

    def test_fused_hf_experts(self):
        """transformers 5's fused expert tensors (gate_up_proj [E, 2h, d], gate rows first;
        down_proj [E, d, h]) with a router module holding weight [E, d], top_k and
        norm_topk_prob: outputs, gradients and the round trip."""
        torch = self.torch
        from moeblaze.torch import MoELayer
        from support import fused_hf_block
        d, h, E, k = 16, 24, 6, 2
        make_block = lambda: fused_hf_block(torch, d, h, E, k)  # noqa: E731

        block = make_block()
        layer = MoELayer.from_qwen3_moe(block, max_tokens=64)
        x = torch.randn(25, d)
        xr, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref, (y, _, _) = block(xr), layer(xl)
        self.assertLess((y - ref).abs().max().item(), 1e-5)
        dy = torch.randn_like(ref)
        (ref * dy).sum().backward()
        (y * dy).sum().backward()
        rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)  # noqa: E731
        self.assertLess(rel(xl.grad, xr.grad), 1e-4)
        self.assertLess(rel(layer.router_weight.grad, block.gate.weight.grad), 1e-4)
        self.assertLess(rel(layer.w_gate_up.grad.transpose(1, 2), block.experts.gate_up_proj.grad), 1e-4)
        self.assertLess(rel(layer.w_down.grad.transpose(1, 2), block.experts.down_proj.grad), 1e-4)
        other = make_block()
        layer.store_fused_experts(other.gate.weight, other.experts.gate_up_proj, other.experts.down_proj)
        self.assertTrue(torch.equal(other(x), block(x)))

    def _torchtitan_moe(self, d, h, E, k, score_func, route_norm):
        """torchtitan's MoE math in plain PyTorch: router nn.Linear, fp32 softmax or sigmoid,
        top-k, optional renormalisation, GroupedExperts w1/w3 [E, h, d] and w2 [E, d, h] run
        expert by expert, gates applied to the experts' outputs."""
        torch = self.torch
        import torch.nn as nn
        import torch.nn.functional as F

        class Router(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(d, E, bias=False)
                self.top_k, self.score_func, self.route_norm, self.route_scale = k, score_func, route_norm, 1.0

        class Experts(nn.Module):
            def __init__(self):
                super().__init__()
                self.w1 = nn.Parameter(torch.randn(E, h, d) / d ** 0.5)
                self.w2 = nn.Parameter(torch.randn(E, d, h) / h ** 0.5)
                self.w3 = nn.Parameter(torch.randn(E, h, d) / d ** 0.5)

        class TitanMoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router, self.experts = Router(), Experts()
                self.score_before_experts, self.expert_bias, self.shared_experts = False, None, None

            def forward(self, x):
                s = self.router.gate(x).float()
                s = F.softmax(s, dim=1) if score_func == "softmax" else torch.sigmoid(s)
                w, i = s.topk(k, dim=1)
                if route_norm:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                y = torch.zeros_like(x)
                ex = self.experts
                for j in range(k):
                    for e in range(E):
                        m = (i[:, j] == e).nonzero()[:, 0]
                        if m.numel():
                            xe = x[m]
                            o = (F.silu(xe @ ex.w1[e].t()) * (xe @ ex.w3[e].t())) @ ex.w2[e].t()
                            y = y.index_add(0, m, w[m, j:j + 1] * o)
                return y
        return TitanMoE()

    def test_torchtitan(self):
        torch = self.torch
        from moeblaze.torch import MoELayer
        d, h, E, k = 16, 24, 6, 2
        for score_func, route_norm in (("softmax", False), ("sigmoid", True)):
            titan = self._torchtitan_moe(d, h, E, k, score_func, route_norm)
            layer = MoELayer.from_torchtitan(titan, max_tokens=64)
            x = torch.randn(30, d)
            xr, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref, (y, _, _) = titan(xr), layer(xl)
            self.assertLess((y - ref).abs().max().item(), 1e-5, score_func)
            dy = torch.randn_like(ref)
            (ref * dy).sum().backward()
            (y * dy).sum().backward()
            rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)  # noqa: E731
            self.assertLess(rel(xl.grad, xr.grad), 1e-4)
            self.assertLess(rel(layer.router_weight.grad, titan.router.gate.weight.grad), 1e-4)
            self.assertLess(rel(layer.w_gate_up.grad[:, :, :h].transpose(1, 2), titan.experts.w1.grad), 1e-4)
            self.assertLess(rel(layer.w_gate_up.grad[:, :, h:].transpose(1, 2), titan.experts.w3.grad), 1e-4)
            self.assertLess(rel(layer.w_down.grad.transpose(1, 2), titan.experts.w2.grad), 1e-4)
            other = self._torchtitan_moe(d, h, E, k, score_func, route_norm)
            layer.store_grouped_experts(other.router.gate, other.experts.w1, other.experts.w2, other.experts.w3)
            self.assertTrue(torch.equal(other(x), titan(x)))
        titan.score_before_experts = True
        with self.assertRaises(ValueError):
            MoELayer.from_torchtitan(titan)

    def test_module_parameters_and_compile(self):
        torch = self.torch
        from moeblaze.torch import MoELayer
        layer = MoELayer(hidden_size=8, ffn_hidden_size=12, num_experts=4, top_k=2,
                         max_tokens=32, aux_loss_coeff=0.01)
        self.assertEqual([n for n, _ in layer.named_parameters()], ["router_weight", "w_gate_up", "w_down"])
        self.assertEqual(tuple(layer.w_gate_up.shape), (4, 8, 24))
        x = torch.randn(2, 7, 8)

        def step(module):
            for p_ in module.parameters():
                p_.grad = None
            y, aux, z = module(x)
            ((y * y).sum() + aux + z).backward()
            return [y.detach()] + [p_.grad.clone() for p_ in module.parameters()]
        eager = step(layer)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        for a, b in zip(step(compiled), eager):
            self.assertTrue(torch.equal(a, b))

    def test_weight_layout_out_in(self):
        """weight_layout="out_in" keeps w_gate_up [E, 2h, d] and w_down [E, d, h] (nn.Linear's
        layout) and hands the library transposed views: the same outputs and gradients (as
        transposes) as the default layout, converters included, and compile fullgraph."""
        torch = self.torch
        from moeblaze.torch import MoELayer
        kw = dict(hidden_size=8, ffn_hidden_size=12, num_experts=4, top_k=2, max_tokens=32)
        a = MoELayer(**kw)
        b = MoELayer(weight_layout="out_in", **kw)
        self.assertEqual(tuple(b.w_gate_up.shape), (4, 24, 8))
        self.assertEqual(tuple(b.w_down.shape), (4, 8, 12))
        self.assertIn("weight_layout=out_in", repr(b))
        with torch.no_grad():
            b.router_weight.copy_(a.router_weight)
            b.w_gate_up.copy_(a.w_gate_up.transpose(1, 2))
            b.w_down.copy_(a.w_down.transpose(1, 2))
        x = torch.randn(2, 9, 8)

        def step(module):
            for p_ in module.parameters():
                p_.grad = None
            y, aux, z = module(x)
            ((y * y).sum() + aux + z).backward()
            return y.detach(), [p_.grad.clone() for p_ in module.parameters()]
        ya, ga = step(a)
        yb, gb = step(b)
        close = lambda u, v: (u - v).abs().max().item() <= 1e-5 * max(1.0, v.abs().max().item())  # noqa: E731
        self.assertTrue(close(yb, ya))
        self.assertTrue(close(gb[0], ga[0]))
        self.assertTrue(close(gb[1], ga[1].transpose(1, 2)))
        self.assertTrue(close(gb[2], ga[2].transpose(1, 2)))
        self.assertTrue(gb[1].is_contiguous() and gb[2].is_contiguous())
        compiled = torch.compile(b, fullgraph=True, backend="aot_eager")
        yc, gc_ = step(compiled)
        self.assertTrue(torch.equal(yc, yb))
        for u, v in zip(gc_, gb):
            self.assertTrue(torch.equal(u, v))
        # converters and store_* work through the views
        c = MoELayer(weight_layout="out_in", **kw)
        tw = [torch.empty(4, 12, 8), torch.empty(4, 8, 12), torch.empty(4, 12, 8)]
        router = torch.nn.Linear(8, 4, bias=False)
        a.store_grouped_experts(router, *tw)
        c.load_grouped_experts(router, *tw)
        self.assertTrue(torch.equal(c.w_gate_up, b.w_gate_up))
        self.assertTrue(torch.equal(c.w_down, b.w_down))
        with self.assertRaises(ValueError):
            MoELayer(weight_layout="columns", **kw)

    def test_copy_and_lifetime(self):
        """copy.deepcopy and pickling rebuild the layer with its own spec; a layer that is
        garbage-collected takes its spec (and handles) with it."""
        import copy
        import pickle
        torch = self.torch
        from moeblaze.torch import LayerSpec, MoELayer
        layer = MoELayer(hidden_size=8, ffn_hidden_size=12, num_experts=4, top_k=2, max_tokens=16)
        x = torch.randn(6, 8)
        want = layer(x)[0]
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            self.assertNotEqual(other.spec.id, layer.spec.id)
            self.assertTrue(torch.equal(other(x)[0], want))
        spec_id = layer.spec.id
        del layer, want  # the layer, and the graph that keeps its spec until backward
        gc.collect()
        with self.assertRaises(ValueError):
            LayerSpec.get(spec_id)

    def test_bad_input(self):
        torch = self.torch
        from moeblaze.torch import MoELayer
        layer = MoELayer(hidden_size=8, ffn_hidden_size=12, num_experts=4, top_k=2, max_tokens=16)
        with self.assertRaises(ValueError) as ctx:
            layer(torch.randn(4, 9))
        self.assertIn("features", str(ctx.exception))
        with self.assertRaises(MoEBlazeError) as ctx:  # more tokens than max_tokens
            layer(torch.randn(17, 8))
        self.assertIn("max_tokens", str(ctx.exception).lower())
        with self.assertRaises(TypeError):
            MoELayer(hidden_size=8, ffn_hidden_size=12, num_experts=4, top_k=2, dtype=torch.int32)


class TestTorchCuda(unittest.TestCase):
    """On an sm_90 GPU (skipped elsewhere; scripts/gpu-check.sh pytorch runs it): MoELayer in
    bf16 on the fused engine against the same weights on the CPU engine in fp32 (outputs and
    gradients), then torch.compile(fullgraph=True, mode="reduce-overhead"), whose CUDA-graph
    replays must give the eager step's bits."""

    def setUp(self):
        self.torch = _torch()
        if self.torch is None:
            self.skipTest("torch is not installed")
        if not self.torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        if self.torch.cuda.get_device_capability()[0] != 9:
            self.skipTest("the fused engine needs an sm_90 GPU")

    def test_fused_layer_eager_compile_graphs(self):
        torch = self.torch
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for layout in ("in_out", "out_in"):
            with self.subTest(weight_layout=layout):
                self._fused_layer(torch, MoELayer, layout)

    def test_bad_caller_ids_raise_on_the_fused_engine(self):
        """The fused engine finds bad caller ids on the device (no host sync): the operator turns
        its STATUS into an asynchronous assert, so the step raises naming the cause instead of
        returning NaN. A failed device assert ends the process's CUDA context, so the step runs
        in a child process."""
        import subprocess
        code = (
            "import torch, moeblaze\n"
            "from moeblaze.torch import MoE\n"
            "moe = MoE(num_experts=8, top_k=2, hidden_size=64, ffn_hidden_size=64, max_tokens=64,\n"
            "          activation='swiglu', activation_dtype='bf16', weight_dtype='bf16',\n"
            "          engine=moeblaze.Engine.CUDA_FUSED)\n"
            "bf = dict(device='cuda', dtype=torch.bfloat16)\n"
            "x = torch.randn(32, 64, **bf)\n"
            "ids = torch.randint(0, 8, (32, 1), device='cuda').repeat(1, 2)\n"
            "ids[:, 1] = (ids[:, 0] + 1) % 8\n"
            "ids[5, 1] = 9\n"
            "w = torch.rand(32, 2, device='cuda')\n"
            "y = moe(x, torch.randn(8, 64, 128, **bf), torch.randn(8, 64, 64, **bf),\n"
            "        topk_indices=ids, topk_weights=w)\n"
            "torch.cuda.synchronize()\n"
            "print('no error raised')\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(_HERE),
                                                                          os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=300)
        out = p.stdout + p.stderr
        self.assertNotEqual(p.returncode, 0, out)
        self.assertNotIn("no error raised", out)
        # torch prints the assert's message where its CUDA build keeps it, else the generic
        # device-side assert
        self.assertTrue("topk_indices" in out or "device-side assert" in out, out)
        print("\n    bad caller ids on the fused engine raised: %s" % out.strip().splitlines()[-1])

    def test_backward_allocates_no_saved_sized_gradient(self):
        """Backward's peak above the forward's memory is its workspace and the gradients: the
        saved buffer's output gets no zero gradient from autograd (it is as large as the saved
        activations; before the fix this halved the tokens a training step fits)."""
        torch = self.torch
        from moeblaze.torch import MoE
        E, k, d, h, L = 8, 2, 256, 1024, 16384
        moe = MoE(num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h, max_tokens=L,
                  activation="swiglu", activation_dtype="bf16", weight_dtype="bf16",
                  engine=moeblaze.Engine.CUDA_FUSED)
        try:
            bf = dict(device="cuda", dtype=torch.bfloat16)
            x = torch.randn(L, d, **bf).requires_grad_()
            logits = torch.randn(L, E, **bf).requires_grad_()
            wgu = (torch.randn(E, d, 2 * h, **bf) * d ** -0.5).requires_grad_()
            wd = (torch.randn(E, h, d, **bf) * h ** -0.5).requires_grad_()
            y = moe(x, wgu, wd, router_logits=logits)
            dy = torch.randn_like(y)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y.backward(dy)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            workspace = moe.handle_for(x.device).workspace_size(moeblaze.Pass.BACKWARD, L)
            grads = sum(t.numel() * t.element_size() for t in (x, logits, wgu, wd))
            saved = k * 2 * h * 2 * L  # SAVE_PREACT's pre rows alone
            self.assertLess(extra, workspace + grads + 2 ** 20 + saved // 2,
                            "backward allocated %d bytes above the forward's memory" % extra)
        finally:
            moe.close()

    def test_routing_options_fused_and_compiled(self):
        """DeepSeek-V3's routing (sigmoid, an expert bias, 2 of 4 expert groups, route scale 2.5,
        the sequence-wise balance loss) on the fused engine: against the CPU engine, and under
        torch.compile's CUDA graphs."""
        torch = self.torch
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        self._fused_layer(torch, MoELayer, "in_out", score_function="sigmoid", normalize_topk=1,
                          num_expert_groups=4, topk_groups=2, route_scale=2.5, expert_bias=True,
                          aux_loss_coeff=0.01, balance_per_sequence=True)

    def test_token_mask_is_the_unmasked_tokens_alone(self):
        """MoELayer(x, token_mask=m) on the fused engine: for the unmasked tokens, y, the losses and
        every gradient of the same layer run on those tokens alone; y and dx zero elsewhere."""
        torch = self.torch
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        layer = MoELayer(256, 128, 16, 4, max_tokens=512, dtype=torch.bfloat16, device="cuda",
                         engine=moeblaze.Engine.CUDA_FUSED, aux_loss_coeff=0.01, z_loss_coeff=1e-3)
        x = torch.randn(2, 100, 256, device="cuda").to(torch.bfloat16)
        dy = torch.randn_like(x)
        mask = torch.rand(2, 100, device="cuda") > 0.3

        def step(xx, gy, **kw):
            for p_ in layer.parameters():
                p_.grad = None
            xx = xx.clone().requires_grad_()
            y, aux, z = layer(xx, **kw)
            ((y.float() * gy.float()).sum() + aux + z).backward()
            return y.detach(), aux.detach(), z.detach(), xx.grad, [p_.grad.clone() for p_ in layer.parameters()]

        y, aux, z, dx, grads = step(x, dy, token_mask=mask)
        y1, aux1, z1, dx1, grads1 = step(x[mask], dy[mask])
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()  # noqa: E731
        self.assertLess(rel(y[mask], y1), 1e-3)
        self.assertLess(rel(dx[mask], dx1), 1e-3)
        self.assertEqual(float(y[~mask].abs().max()), 0.0)
        self.assertEqual(float(dx[~mask].abs().max()), 0.0)
        self.assertLess(abs(aux.item() - aux1.item()) / aux1.item(), 1e-4)
        self.assertLess(abs(z.item() - z1.item()) / z1.item(), 1e-4)
        for g, g1 in zip(grads, grads1):
            self.assertLess(rel(g, g1), 1e-3)

    def test_shared_expert_beside_is_the_same_bits(self):
        """shared_expert_overlap=True (the shared expert on a second stream, forward and backward)
        gives the bits of the in-line layer, on both CUDA engines, eagerly and replayed from a
        torch.cuda.graph capture; the shared expert's part is checked against the CPU engine."""
        torch = self.torch
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for engine in (moeblaze.Engine.CUDA_FUSED, moeblaze.Engine.CUDA_CUBLASLT):
            with self.subTest(engine=engine):
                kw = dict(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, max_tokens=512,
                          shared_expert_hidden=384, shared_expert_gate=True, aux_loss_coeff=0.01)
                layer = MoELayer(dtype=torch.bfloat16, device="cuda", engine=engine, **kw)
                cpu = MoELayer(dtype=torch.float32, device="cpu", **kw)
                cpu.load_state_dict({k: v.float().cpu() for k, v in layer.state_dict().items()})
                x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
                dy = torch.randn_like(x)

                def step(module, xx, gy, overlap):
                    module.shared_expert_overlap = overlap
                    for p_ in module.parameters():
                        p_.grad = None
                    xx = xx.detach().requires_grad_()
                    y, aux, _ = module(xx)
                    ((y.float() * gy.float()).sum() + aux).backward()
                    return [y.detach(), xx.grad] + [p_.grad.clone() for p_ in module.parameters()]

                inline = step(layer, x, dy, False)
                beside = step(layer, x, dy, True)
                names = ["y", "dx"] + ["d " + n_ for n_, _ in layer.named_parameters()]
                for name, a, b in zip(names, beside, inline):
                    self.assertTrue(torch.equal(a, b), "%s differs by %g" % (name, (a.float() - b.float()).abs().max()))
                ref = step(cpu, x.float().cpu(), dy.float().cpu(), False)
                for got, want in zip(beside, ref):
                    err = (got.float().cpu() - want).norm() / want.norm().clamp_min(1e-12)
                    self.assertLess(err.item(), 2e-2)
                if engine != moeblaze.Engine.CUDA_FUSED:
                    continue  # the cuBLASLt engine refuses capture
                static_x = x.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
                    step(layer, static_x, dy, True)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                layer.shared_expert_overlap = True
                for p_ in layer.parameters():
                    p_.grad = None
                xs = static_x.detach().requires_grad_()
                with torch.cuda.graph(g):
                    y, aux, _ = layer(xs)
                    ((y.float() * dy.float()).sum() + aux).backward()
                static_x.copy_(torch.randn_like(x))  # xs is a view of it
                g.replay()
                torch.cuda.synchronize()
                replayed = [y.detach().clone(), xs.grad.clone()] + [p_.grad.clone() for p_ in layer.parameters()]
                eager = step(layer, static_x, dy, False)
                for name, a, b in zip(names, replayed, eager):
                    self.assertTrue(torch.equal(a, b), "replayed %s differs by %g" % (name, (a.float() - b.float()).abs().max()))

    def _fused_layer(self, torch, MoELayer, layout, **options):
        kw = dict(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, max_tokens=512,
                  weight_layout=layout, **options)
        layer = MoELayer(dtype=torch.bfloat16, device="cuda", engine=moeblaze.Engine.CUDA_FUSED, **kw)
        if options.get("expert_bias"):
            with torch.no_grad():
                layer.expert_bias.normal_(0.0, 0.05)
        cpu = MoELayer(dtype=torch.float32, device="cpu", **kw)
        cpu.load_state_dict({k: v.float().cpu() for k, v in layer.state_dict().items()})
        x = torch.randn(2, 100, 256, device="cuda").to(torch.bfloat16)
        dy = torch.randn_like(x)

        def step(module, xx, gy):
            for p_ in module.parameters():
                p_.grad = None
            xx = xx.clone().requires_grad_()
            y, aux, z = module(xx)
            ((y.float() * gy.float()).sum() + aux + z).backward()
            return [y.detach(), xx.grad] + [p_.grad.clone() for p_ in module.parameters()]

        eager = step(layer, x, dy)
        ref = step(cpu, x.float().cpu(), dy.float().cpu())
        for got, want in zip(eager, ref):
            err = (got.float().cpu() - want).norm() / want.norm().clamp_min(1e-12)
            self.assertLess(err.item(), 2e-2)
        compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, recording, then replays
            got = step(compiled, x, dy)
        for a, b in zip(got, eager):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main()
