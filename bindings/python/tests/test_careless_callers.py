"""The binding under careless and hostile use: closing a handle under a running call, integers
that do not fit their C type, log callbacks that call the library, saved tensors moved by
saved-tensor hooks, layouts the library does not take, empty batches, temporary layers and
state_dicts of the other weight layout. Each case failed (crash, hang, wrong answer or a
spurious error) before the binding handled it."""
import threading
import time
import unittest

from support import torch_or_none as _torch

import moeblaze
from moeblaze import ArgKind, BindingError, Pass, Status
from moeblaze import _types


def _layer_attrs(**extra):
    attrs = dict(num_experts=4, top_k=2, hidden_size=16, ffn_hidden_size=24, max_tokens=2048,
                 activation="swiglu", device_type="cpu", activation_dtype="f32",
                 weight_dtype="f32", num_threads=2)
    attrs.update(extra)
    return attrs


class _Problem:
    """One forward on a CPU handle with random f32 inputs (standard library only)."""

    def __init__(self, handle, L, seed=1):
        import random
        rnd = random.Random(seed)
        E, d, h = 4, 16, 24
        self.L = L

        def buf(n, scale=1.0):
            return moeblaze.AlignedBuffer(4 * n), [rnd.gauss(0.0, scale) for _ in range(n)]

        def fill(b, vals):
            b.memoryview().cast("f")[:] = __import__("array").array("f", vals)
            return b
        self.x = fill(*buf(L * d))
        self.logits = fill(*buf(L * E))
        self.wgu = fill(*buf(E * d * 2 * h, 0.2))
        self.wd = fill(*buf(E * h * d, 0.2))
        self.y = moeblaze.AlignedBuffer(4 * L * d)
        self.ws = moeblaze.AlignedBuffer(handle.workspace_size(Pass.FORWARD_TRAINING, L))
        self.saved = moeblaze.AlignedBuffer(handle.saved_size(L))
        t = lambda b, shape: moeblaze.host_tensor(b, shape, "f32", writable=True)  # noqa: E731
        self.args = moeblaze.ArgList([
            (ArgKind.INPUT, t(self.x, (L, d))), (ArgKind.ROUTER_LOGITS, t(self.logits, (L, E))),
            (ArgKind.W_GATE_UP, t(self.wgu, (E, d, 2 * h))), (ArgKind.W_DOWN, t(self.wd, (E, h, d))),
            (ArgKind.OUTPUT, t(self.y, (L, d)))])

    def forward(self, handle):
        handle.forward(Pass.FORWARD_TRAINING, self.args, self.ws, self.saved)
        return bytes(self.y.memoryview())


class TestHandleLifetime(unittest.TestCase):
    def test_close_waits_for_calls_in_flight(self):
        h = moeblaze.Handle(**_layer_attrs())
        p = _Problem(h, 2048)
        want = p.forward(h)
        for _ in range(3):
            h = moeblaze.Handle(**_layer_attrs())
            got, errors = [], []

            def run():
                try:
                    got.append(p.forward(h))
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
            t = threading.Thread(target=run)
            t.start()
            deadline = time.time() + 10
            while not h._in_flight and t.is_alive() and time.time() < deadline:
                time.sleep(0)
            h.close()  # waits for the forward in flight; never frees under it
            t.join()
            self.assertEqual(errors, [])
            self.assertEqual(got, [want])
            self.assertTrue(h.closed)
            with self.assertRaises(BindingError):
                p.forward(h)

    def test_close_from_inside_a_call_is_refused(self):
        h = moeblaze.Handle(**_layer_attrs())
        p = _Problem(h, 8)
        seen = []

        def callback(level, func, msg):
            try:
                h.close()
                seen.append("closed")
            except BindingError as exc:
                seen.append(str(exc))
        moeblaze.set_log_callback(callback, 1)
        try:
            with self.assertRaises(moeblaze.MoEBlazeError):
                h.forward(Pass.FORWARD_TRAINING, p.args, p.ws, None)  # no saved buffer: fails
        finally:
            moeblaze.set_log_callback(None)
        self.assertEqual(len(seen), 1)
        self.assertIn("from inside a call", seen[0])
        self.assertFalse(h.closed)
        p.forward(h)
        h.close()


class TestIntegers(unittest.TestCase):
    def test_out_of_range_integers_are_refused(self):
        with self.assertRaises(BindingError) as cm:
            moeblaze.Config(**_layer_attrs(max_tokens=2 ** 64 + 8))
        self.assertIn("max_tokens", str(cm.exception))
        with moeblaze.Config() as cfg:
            with self.assertRaises(BindingError):
                cfg.set(2 ** 32 + 1, 2)  # would have set TOP_K (attribute 1)
            with self.assertRaises(BindingError):
                cfg.set("window_tokens", 2 ** 63)
            with self.assertRaises(BindingError):
                cfg.set("top_k", 2.5)
            self.assertEqual(cfg.get("top_k"), 0)
        h = moeblaze.Handle(**_layer_attrs())
        for bad in (2 ** 63, -2 ** 63 - 1):
            with self.assertRaises(BindingError):
                h.workspace_size(Pass.FORWARD_TRAINING, bad)
        with self.assertRaises(BindingError):
            h.workspace_size(2 ** 32, 4)
        with self.assertRaises(BindingError):
            _types.Tensor.make(0, (2 ** 63, 4), "f32")
        with self.assertRaises(BindingError):
            _types.Tensor.make(0, (4, 4), "f32", byte_offset=-1)
        with self.assertRaises(BindingError):
            _types.Tensor.make(0, (4, 4), "f32", device_id=2 ** 31)
        with self.assertRaises(BindingError):
            moeblaze.ArgList().add(2 ** 32 + ArgKind.INPUT, _types.Tensor.make(0, (0, 16), "f32"))
        with self.assertRaises(BindingError):
            moeblaze.set_log_callback(lambda *a: None, 2 ** 32 + 1)
        h.close()

    def test_status_names_of_any_integer(self):
        self.assertEqual(moeblaze.status_name(2 ** 40), "MOEBLAZE_STATUS_UNKNOWN")
        self.assertEqual(moeblaze.status_name(-2 ** 40), "MOEBLAZE_STATUS_UNKNOWN")
        self.assertEqual(moeblaze.status_name(2 ** 32 + 1), "MOEBLAZE_STATUS_UNKNOWN")
        self.assertEqual(moeblaze.status_name(Status.INVALID_ARGUMENT),
                         "MOEBLAZE_STATUS_INVALID_ARGUMENT")


class TestLogCallback(unittest.TestCase):
    def test_non_callables_are_refused(self):
        for bad in (42, "print", object()):
            with self.assertRaises(TypeError):
                moeblaze.set_log_callback(bad)

    def _in_thread(self, fn, timeout=30):
        """Runs fn on a thread; fails (instead of hanging the suite) if it deadlocks."""
        errors = []

        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        self.assertFalse(t.is_alive(), "deadlocked")
        if errors:
            raise errors[0]

    def test_callback_that_calls_the_library(self):
        calls = []

        def uninstall_and_fail(level, func, msg):
            calls.append(msg)
            with self.assertRaises(moeblaze.MoEBlazeError):
                moeblaze.Config().set("top_k", -1)  # a failing call from inside the callback
            moeblaze.set_log_callback(None)

        def body():
            moeblaze.set_log_callback(uninstall_and_fail, 1)
            with moeblaze.Config() as cfg:
                with self.assertRaises(moeblaze.MoEBlazeError) as cm:
                    cfg.set("top_k", -5)
                self.assertIn("top_k = -5", cm.exception.message)
                with self.assertRaises(moeblaze.MoEBlazeError):
                    cfg.set("top_k", -6)  # uninstalled: not delivered
        self._in_thread(body)
        self.assertEqual(len(calls), 1)
        self.assertIn("top_k = -5", calls[0])

    def test_callbacks_replaced_under_load(self):
        stop = threading.Event()

        def noise():
            while not stop.is_set():
                try:
                    moeblaze.Config().set("top_k", -1)
                except moeblaze.MoEBlazeError:
                    pass
        workers = [threading.Thread(target=noise) for _ in range(4)]
        for w in workers:
            w.start()

        def body():
            for i in range(40):
                seen = []
                moeblaze.set_log_callback(lambda lvl, f, m: (seen.append(m), moeblaze.set_log_callback(None) if i % 2 else None), 1)
                time.sleep(0.001)
                moeblaze.set_log_callback(None)
        try:
            self._in_thread(body)
        finally:
            stop.set()
            for w in workers:
                w.join()


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestTorchCarelessUse(unittest.TestCase):
    def setUp(self):
        torch = _torch()
        import moeblaze.torch as mt
        self.torch, self.mt = torch, mt
        torch.manual_seed(0)
        self.layer = mt.MoELayer(16, 24, 4, 2, max_tokens=64, num_threads=2, aux_loss_coeff=0.01)
        self.x = torch.randn(24, 16, requires_grad=True)

    def _step(self, x=None, hooks=None, loss=None):
        x = self.x if x is None else x
        x.grad = None
        for p in self.layer.parameters():
            p.grad = None
        if hooks is not None:
            with hooks:
                y, aux, _ = self.layer(x)
        else:
            y, aux, _ = self.layer(x)
        (loss(y) if loss else (y.square().sum() + aux)).backward()
        return [x.grad] + [p.grad for p in self.layer.parameters()]

    def _same(self, a, b):
        for u, v in zip(a, b):
            self.assertTrue(self.torch.equal(u, v))

    def test_saved_tensor_relocated_by_hooks(self):
        torch = self.torch
        want = self._step()

        def shifted(t):  # a copy that starts 64 bytes into a fresh block
            if t.dtype != torch.uint8:
                return t
            big = torch.empty(t.numel() + 64, dtype=torch.uint8, device=t.device)
            big[64:].copy_(t)
            return big[64:]

        def odd(t):  # and one at an odd address
            if t.dtype != torch.uint8:
                return t
            big = torch.empty(t.numel() + 1, dtype=torch.uint8, device=t.device)
            big[1:].copy_(t)
            return big[1:]
        for pack in (lambda t: t.clone(), shifted, odd):
            for _ in range(4):
                self._same(self._step(hooks=torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)), want)
        self._same(self._step(hooks=torch.autograd.graph.save_on_cpu()), want)
        from torch.utils.checkpoint import checkpoint
        self.x.grad = None
        checkpoint(lambda t: self.layer(t)[0], self.x, use_reentrant=False).square().sum().backward()
        self.assertTrue(torch.equal(self.x.grad, self._step(loss=lambda y: y.square().sum())[0]))

    def test_broadcast_and_odd_layouts(self):
        torch = self.torch
        self._step(loss=lambda y: y.sum(0).sum())  # dy is a stride-0 broadcast
        xe = torch.randn(1, 16).expand(24, 16).requires_grad_()
        got = self._step(x=xe, loss=lambda y: y.sum())
        xc = xe.detach().contiguous().requires_grad_()
        want = self._step(x=xc, loss=lambda y: y.sum())
        self._same(got[1:], want[1:])
        self.assertTrue(torch.allclose(got[0], want[0]))
        xt = torch.randn(16, 24).t().requires_grad_()  # columns of unit stride
        self._step(x=xt)

    def test_layer_integers_are_checked(self):
        with self.assertRaises(BindingError):
            self.mt.MoELayer(16, 24, 4, 2, max_tokens=2 ** 64 + 8)
        with self.assertRaises(BindingError):
            self.mt.MoELayer(16, 24, 4, 2, max_tokens=64, window_tokens=2 ** 64 + 1)

    def test_empty_batch(self):
        torch = self.torch
        x0 = torch.randn(0, 16, requires_grad=True)
        y, aux, z = self.layer(x0)
        self.assertEqual(tuple(y.shape), (0, 16))
        (y.sum() + aux).backward()
        self.assertEqual(tuple(x0.grad.shape), (0, 16))
        self.assertEqual(float(self.layer.w_gate_up.grad.abs().sum()), 0.0)

    def test_temporary_functional_moe(self):
        torch = self.torch
        import gc
        E, d, h, k = 4, 16, 24, 2
        w1 = torch.randn(E, d, 2 * h, requires_grad=True)
        w2 = torch.randn(E, h, d, requires_grad=True)
        lg = torch.randn(24, E, requires_grad=True)
        y = self.mt.MoE(num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h, max_tokens=64,
                        activation_dtype="f32", weight_dtype="f32")(self.x, w1, w2, router_logits=lg)
        gc.collect()
        y.sum().backward()  # the graph kept the layer alive
        self.assertIsNotNone(w1.grad)

    def test_state_dict_of_the_other_layout(self):
        torch = self.torch
        mt = self.mt
        a = mt.MoELayer(16, 16, 4, 2, activation="silu", max_tokens=64, weight_layout="in_out")
        b = mt.MoELayer(16, 16, 4, 2, activation="silu", max_tokens=64, weight_layout="out_in")
        x = torch.randn(10, 16)
        b.load_state_dict(a.state_dict())  # d == h: the shapes match, the layouts do not
        self.assertTrue(torch.allclose(a(x)[0], b(x)[0], atol=1e-6))
        a.load_state_dict(b.state_dict())
        self.assertTrue(torch.allclose(a(x)[0], b(x)[0], atol=1e-6))
        self.assertEqual(list(a.state_dict()), ["router_weight", "w_gate_up", "w_down"])  # no extra key
        legacy = dict(a.state_dict())  # a plain dict: no metadata, so no layout record
        c = mt.MoELayer(16, 16, 4, 2, activation="silu", max_tokens=64)
        c.load_state_dict(legacy)  # a checkpoint without the record: this layer's layout
        self.assertTrue(torch.equal(c(x)[0], a(x)[0]))


if __name__ == "__main__":
    unittest.main()
