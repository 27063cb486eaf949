"""tpsample.replay: argument substitution and keys (the GPU replay path is exercised by the
multi-GPU tests, where every sampler call after the first is a replay)."""
import inspect

import pytest
import torch

from tpsample import replay


def kernel_sig(h_ptr, w_ptr, s_ptr, B, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = 7):  # noqa: F821
    pass


class FakeJit:
    fn = staticmethod(kernel_sig)


class FakeCompiled:
    function, packed_metadata = "f", "m"

    def __init__(self):
        self.calls = []

    def run(self, gx, gy, gz, stream, function, meta, launch_meta, enter, exit_, *args):
        self.calls.append(((gx, gy, gz), args))


def test_replay_substitutes_per_call_tensors_and_appends_constexprs():
    h, w, s = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    compiled = FakeCompiled()
    rep = replay.Replay([(FakeJit, compiled, (3,), (h, w, s, 5), dict(BLOCK=16))],
                        dict(hidden=h, seed=s))
    h2, s2 = torch.ones(4), torch.ones(4)
    rep(0, hidden=h2, seed=s2)
    grid, args = compiled.calls[0]
    assert grid == (3, 1, 1)
    assert args[0] is h2 and args[1] is w and args[2] is s2 and args[3:] == (5, 16, 7)


def test_replay_aliased_names_fill_from_the_first():
    t = torch.zeros(4)
    rep = replay.Replay([(FakeJit, FakeCompiled(), (1,), (t, t, t, 1), dict(BLOCK=16))],
                        dict(inv_temp=t, seed=t))
    assert rep.launches[0][3] == [(0, "inv_temp", None), (1, "inv_temp", None),
                                  (2, "inv_temp", None)]


def test_replay_rebases_descriptors_of_named_tensors():
    """A TMA descriptor argument built on a named tensor is copied onto the new tensor (its
    shape and strides kept: the call key fixes them); the recorded descriptor is unchanged
    and a descriptor of an unnamed tensor is passed as recorded."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    h, w, s = torch.zeros(8, 8), torch.zeros(16, 8), torch.zeros(4)
    hd = TensorDescriptor(h, [2, 4, 8], [8, 16, 1], [1, 2, 8])  # a strided view's geometry
    wd = TensorDescriptor.from_tensor(w, [8, 8])
    compiled = FakeCompiled()
    rep = replay.Replay([(FakeJit, compiled, (2,), (hd, wd, s, 5), dict(BLOCK=16))],
                        dict(hidden=h, seed=s))
    h2, s2 = torch.ones(8, 8), torch.ones(4)
    rep(0, hidden=h2, seed=s2)
    args = compiled.calls[0][1]
    assert args[0] is not hd and args[0].base is h2 and hd.base is h
    assert (args[0].shape, args[0].strides, args[0].block_shape) == ([2, 4, 8], [8, 16, 1], [1, 2, 8])
    assert args[1] is wd and args[2] is s2
    # Triton's launcher reads the rebased stand-in as it reads a descriptor on that tensor
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:  # a Triton without the NVIDIA backend: nothing launches anyway
        make_tensordesc_arg = None
    if make_tensordesc_arg is not None:  # (arg, metadata) in Triton 3.6, + one more in 3.9
        extra = (None,) * (len(inspect.signature(make_tensordesc_arg).parameters) - 2)
        fresh = TensorDescriptor(h2, [2, 4, 8], [8, 16, 1], [1, 2, 8])
        got = make_tensordesc_arg(args[0], None, *extra)
        want = make_tensordesc_arg(fresh, None, *extra)
        assert got[0] is h2 and got[1:] == want[1:]
    recorded, slots = rep.launches[0][2], rep.launches[0][3]
    assert recorded[0] is None and recorded[2] is None  # no slot keeps a tensor ...
    assert [d.base for _, _, d in slots if d is not None] == [None]  # ... nor a template


def test_tensor_key_separates_alignment_dtype_and_aliasing():
    a, b = torch.zeros(8), torch.zeros(8)
    base = replay.tensor_key((a, b, None))
    assert replay.tensor_key((torch.zeros(8), torch.zeros(8), None)) == base
    assert replay.tensor_key((a[1:], b, None)) != base        # misaligned pointer
    assert replay.tensor_key((a.double(), b, None)) != base   # another dtype
    assert replay.tensor_key((a, a, None)) != base            # one tensor under two names
    assert replay.tensor_key((a, b, b)) != base


def test_replay_reruns_torch_steps_and_keeps_no_tensors():
    """A recorded torch step (the hybrid's GEMM) is re-run on the new inputs and its new
    result reaches the launch that took the recorded one; no slot holds a tensor afterwards."""
    h, w, s = torch.zeros(4), torch.full((4,), 3.0), torch.zeros(4)
    step = lambda x, y: x * y  # noqa: E731
    recorded = step(h, w)
    compiled = FakeCompiled()
    rep = replay.Replay([(step, None, None, (h, w), recorded),
                         (FakeJit, compiled, (2,), (recorded, w, s, 5), dict(BLOCK=16))],
                        dict(hidden=h, seed=s))
    assert all(a is None or a is w or not isinstance(a, torch.Tensor) for _, _, args, _, _ in rep.launches
               for a in args)
    h2, s2 = torch.full((4,), 2.0), torch.ones(4)
    rep(0, hidden=h2, seed=s2)
    args = compiled.calls[0][1]
    assert torch.equal(args[0], torch.full((4,), 6.0)) and args[1] is w and args[2] is s2
    assert all(a is None or a is w or not isinstance(a, torch.Tensor) for _, _, args, _, _ in rep.launches
               for a in args)


def test_call_replays_keep_only_complete_calls_up_to_the_limit():
    """CallReplays keeps a call with both stages recorded and launches that have Triton's
    launcher API, drops everything when full, and reports its size (the GPU replay test
    relies on len and clear)."""
    calls = replay.CallReplays(limit=2)
    step = [(print, None, None, (), None)]
    launch = [(FakeJit, FakeCompiled(), (1,), (None, None, None, 3), {"BLOCK": 2})]
    calls.add("a", step, {}, launch, {})
    calls.add("b", step, {}, [], {})  # stage 2 not recorded: not kept
    calls.add(None, step, {}, launch, {})  # no key: not kept
    calls.add("e", step, {}, [(FakeJit, object(), (1,), (), {})], {})  # no launcher API: not kept
    assert len(calls) == 1 and calls.get("a") is not None and calls.get("b") is None
    calls.add("c", step, {}, launch, {})
    calls.add("d", step, {}, launch, {})  # full: the earlier calls are dropped
    assert len(calls) == 1 and calls.get("d") is not None
    calls.clear()
    assert len(calls) == 0


def test_split_replays_keep_stage2s_per_stage1():
    """Filtered calls: add_split keeps stage 1 with a dict of stage 2s by their own key,
    add_stage2 adds to it (incomplete logs are not kept), and the limits hold for both."""
    calls = replay.CallReplays(limit=2)
    step = [(print, None, None, (), None)]
    launch = [(FakeJit, FakeCompiled(), (1,), (None, None, None, 3), {"BLOCK": 2})]
    calls.add_split("k", step, {}, "x", launch, {})
    calls.add_split("n", step, {}, "x", [], {})  # stage 2 not recorded: not kept
    assert len(calls) == 1 and calls.get("n") is None
    stage1, stage2s = calls.get("k")
    assert isinstance(stage1, replay.Replay) and list(stage2s) == ["x"]
    calls.add_stage2(stage2s, "y", launch, {})
    calls.add_stage2(stage2s, "z", [(FakeJit, object(), (1,), (), {})], {})  # no launcher API
    assert list(stage2s) == ["x", "y"]
    calls.add_stage2(stage2s, "w", launch, {})  # full: the earlier stage 2s are dropped
    assert list(stage2s) == ["w"] and calls.get("k")[1] is stage2s


def test_replay_is_gated_on_the_tested_triton_versions(monkeypatch):
    assert replay.SUPPORTED == (replay.TRITON_VERSION in replay.TESTED_TRITON)
    monkeypatch.setattr(replay, "ENABLED", False)
    assert not replay.Replay.usable()


def test_recorder_logs_launches_and_steps_only_inside_record():
    replay.run_step(lambda x: x + 1, (1,))
    with replay.record() as log:
        assert replay.run_step(lambda x: x + 1, (1,)) == 2
    assert len(log) == 1 and log[0][1] is None and log[0][4] == 2


def test_direct_launch_passes_what_tritons_launcher_layers_pass(monkeypatch):
    """On Triton 3.6 a replayed launch calls the launcher's C function itself (no per-call
    expansion of descriptors in Python): what that function receives must be exactly what
    Triton's own layers (CudaLauncher.__call__ and the descriptor wrapper, the real code)
    pass it for the same per-call tensors, fixed and per-call descriptors included."""
    import pytest
    if replay.TRITON_VERSION != (3, 6):
        pytest.skip("the direct launch is for Triton 3.6's launcher layout")
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nv
    from triton.runtime import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    def fill_tma(ptr, *geometry):  # the CUtensorMap stand-in: what it was encoded from
        return ("tensormap", ptr, repr(geometry))
    monkeypatch.setattr(driver, "_active", SimpleNamespace(
        utils=SimpleNamespace(fill_tma_descriptor=fill_tma), get_current_stream=lambda i: 0))

    def kernel(h_desc, w_desc, s_ptr, B, BLOCK: "tl.constexpr"):  # noqa: F821
        pass
    signature = {"h_desc": "tensordesc<bf16[16,64]>", "w_desc": "tensordesc<bf16[128,64]>",
                 "s_ptr": "*i64", "B": "i32", "BLOCK": "constexpr"}
    meta = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[16, 64], fp4_padded=False),
            dict(swizzle=3, elem_size=2, elem_type=10, block_size=[128, 64], fp4_padded=False)]
    received = []

    class Launcher(nv.CudaLauncher):  # the real __call__, without compiling a module
        def __init__(self):
            self.num_ctas, self.launch_cooperative_grid, self.launch_pdl = 1, False, True
            self.global_scratch_size = self.profile_scratch_size = 0
            self.global_scratch_align = self.profile_scratch_align = 1
            self.launch = nv.wrap_handle_tensordesc(lambda *a: received.append(a), signature,
                                                    meta)

    compiled = SimpleNamespace(run=Launcher(), function=77, packed_metadata=("packed",))
    jit = SimpleNamespace(fn=kernel)
    h, w, s = (torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16),
               torch.zeros(32, dtype=torch.int64))
    launch = [(jit, compiled, (5, 2), (TensorDescriptor.from_tensor(h, [16, 64]),
                                       TensorDescriptor.from_tensor(w, [128, 64]), s, 32),
               dict(BLOCK=16))]
    h2, s2 = torch.ones(32, 64, dtype=torch.bfloat16), torch.ones(32, dtype=torch.int64)
    for direct in (False, True):
        monkeypatch.setattr(replay.knobs, "DIRECT_LAUNCH", direct)
        rep = replay.Replay(launch, dict(hidden=h, seed=s))
        assert isinstance(rep.launches[0][1], replay._DirectLaunch) == direct
        rep(9, hidden=h2, seed=s2)
    via_triton, direct_call = received
    assert direct_call[:13] == (5, 2, 1, 9, 77, False, True, None, None, ("packed",), None,
                                None, None)
    # a per-call tensor goes as its address (the launcher takes an int as the pointer
    # without asking the driver about it); everything else exactly as Triton passes it
    assert direct_call[:23] == via_triton[:23] and direct_call[24:] == via_triton[24:]
    assert via_triton[23] is s2 and direct_call[23] == s2.data_ptr()
    # each 2-D descriptor expands to (CUtensorMap, 2 sizes, 2 strides)
    assert direct_call[13][1] == h2.data_ptr() and direct_call[18][1] == w.data_ptr()
    assert direct_call[24:] == (32, 16)


def test_run_named_orders_keywords_by_the_signature_and_names_bad_ones(monkeypatch):
    """run_named passes every runtime argument in the kernel's order, whatever the keywords'
    order, and the constexprs by name; a missing or unknown keyword raises naming it."""
    from tpsample import replay as R
    from tpsample.kernels import filter_cut
    calls = []
    monkeypatch.setattr(R, "run_kernel", lambda fn, grid, args, const, opts:
                        calls.append((args, const)))
    names = list(R._signature(filter_cut.cut_step_kernel)[0])
    named = {n: i for i, n in enumerate(names)}
    R.run_named(filter_cut.cut_step_kernel, (1,), {}, STEP=3, **dict(reversed(named.items())))
    assert names[:3] == ["l_ptr", "stride_lb", "N"] and names[-1] == "n_top"
    assert calls[-1] == (tuple(range(len(names))), {"STEP": 3})
    with pytest.raises(TypeError, match=r"missing arguments \['keys_ptr'\]"):
        R.run_named(filter_cut.cut_step_kernel, (1,), {},
                    **{n: v for n, v in named.items() if n != "keys_ptr"})
    with pytest.raises(TypeError, match=r"unknown \['key_ptr'\]"):
        R.run_named(filter_cut.cut_step_kernel, (1,), {}, key_ptr=0, **named)
