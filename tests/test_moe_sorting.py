"""moe_sorting against a per-expert torch loop: the exact same int32 outputs, every element."""
import pytest
import torch

import hipkern
from conftest import poison_sorting_outputs, toolchain_or_skip
from hipkern import jit
from hipkern.ops.moe_sorting import moe_sorting_max_padded
from hipkern.reference import moe_sorting_ref
from hipkern.testing import poison

ONE_BLOCK_MAX_PAIRS = 4096  # csrc_hip/moe_sorting: larger inputs take the multi-block path (checked below)


def _routing(t, k, e, device="cuda"):
    """Distinct experts per token (as a router gives), random over tokens."""
    return torch.rand(t, e, device=device).topk(k, dim=1).indices.to(torch.int32)


def _run(ids, e, bm, expert_map=None):
    n = ids.numel()
    mp = moe_sorting_max_padded(n, e, bm)
    out = tuple(poison(torch.empty(size, dtype=torch.int32, device=ids.device)) for size in (mp, mp // bm, 1))
    res = hipkern.moe_sorting(ids, e, bm, expert_map=expert_map, out=out)
    assert all(r is o for r, o in zip(res, out))
    return res


def _check(ids, e, bm, res, expert_map=None):
    ref = moe_sorting_ref(ids, e, bm, expert_map)
    for name, got, want in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), res, ref):
        assert got.dtype == torch.int32 and got.shape == want.shape, name
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()[:8].tolist()
            pytest.fail(f"{name} differs at {bad}: got {got[bad].tolist()}, want {want[bad].tolist()}")


@pytest.mark.gpu
@pytest.mark.parametrize("e", [8, 64, 256, 257, 1024])
@pytest.mark.parametrize("bm", [1, 8, 16, 32, 64, 128])
def test_matches_reference(e, bm):
    torch.manual_seed(e + bm)
    for t in (0, 1, 3, 32, 129, 2048):
        for k in (1, 2, 8, 9):
            if k > e:
                continue
            ids = _routing(t, k, e)
            _check(ids, e, bm, _run(ids, e, bm))
            poison_sorting_outputs(ids.device, t * k, e, bm)  # outputs from the allocator, poisoned first
            functional = hipkern.moe_sorting(ids, e, bm)
            _check(ids, e, bm, functional)


@pytest.mark.toolchain
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_threshold_constant_is_the_modules(arch, jit_dir, tmp_path):
    """The bound the path tests below aim at is the module's own: no workspace (one block) up to
    ONE_BLOCK_MAX_PAIRS pairs, a workspace (the multi-block path) from one more. Runs without a GPU."""
    toolchain_or_skip(arch, tmp_path)
    mod = jit.load(jit.spec("moe_sorting"), arch)
    for e in (8, 256, 1024):
        assert mod.hk_moe_sorting_workspace(ONE_BLOCK_MAX_PAIRS, e) == 0
        assert mod.hk_moe_sorting_workspace(ONE_BLOCK_MAX_PAIRS + 1, e) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("n_pairs", [ONE_BLOCK_MAX_PAIRS - 1, ONE_BLOCK_MAX_PAIRS, ONE_BLOCK_MAX_PAIRS + 1,
                                     3 * 2048 + 5 + ONE_BLOCK_MAX_PAIRS])
def test_both_paths_around_the_threshold(n_pairs):
    torch.manual_seed(n_pairs)
    ids = torch.randint(0, 64, (n_pairs, 1), device="cuda", dtype=torch.int32)  # repeats within a token too
    _check(ids, 64, 16, _run(ids, 64, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("n_pairs", [1, 255, 256, 257])
@pytest.mark.parametrize("e", [255, 256, 257])
def test_one_step_kernel_around_its_bounds(n_pairs, e):
    """Up to 256 pairs over up to 256 experts take the one-block kernel of one step of pairs a wave and one
    expert a thread; one more pair, the general one-block kernel (still one expert a thread up to 256
    experts); one more expert, four experts a thread. Each matches the reference on each side of both
    bounds, with the pairs spread over the experts or piled onto three."""
    torch.manual_seed(n_pairs * 1000 + e)
    for hi in (e, 3):
        ids = torch.randint(0, hi, (n_pairs, 1), device="cuda", dtype=torch.int32)
        for bm in (1, 32):
            _check(ids, e, bm, _run(ids, e, bm))


# Each kernel of the op, by (pairs, experts): the one-step one-block kernel (<= 256 of both), the general
# one-block kernel with one expert a thread (<= 256 experts) and with four (more), the multi-block path with
# fewer threads in its layout's grid than experts (5000 pairs: 3 chunks of 256 threads, 1024 experts), and one
# expert.
KERNEL_CASES = [(200, 64), (1000, 64), (1000, 300), (5000, 1024), (300, 1), (5000, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("n_pairs,e", KERNEL_CASES)
@pytest.mark.parametrize("bm", [2, 3, 5, 6, 48, 100, 1024])
def test_block_m_of_any_size(n_pairs, e, bm):
    """block_m not a multiple of 4 (segments end between 16-byte words: the padding's 4-byte stores after
    its 16-byte ones), and the largest, on every kernel; the outputs 16-byte aligned (fresh allocations)."""
    torch.manual_seed(n_pairs + e + bm)
    ids = torch.randint(0, e, (n_pairs, 1), device="cuda", dtype=torch.int32)
    res = _run(ids, e, bm)
    assert res[0].data_ptr() % 16 == 0
    _check(ids, e, bm, res)


@pytest.mark.gpu
@pytest.mark.parametrize("n_pairs,e", KERNEL_CASES)
def test_out_of_range_ids_with_an_expert_map_match_the_reference(n_pairs, e):
    """Ids outside [0, E) (both ends of int32 among them) together with an expert map of remote experts
    (-1) and permuted local ids, on every kernel: dropped as the reference drops them, the map read only
    at kept ids."""
    torch.manual_seed(n_pairs * 7 + e)
    ids = torch.randint(-3, e + 3, (n_pairs, 1), device="cuda", dtype=torch.int32)
    ids[0, 0], ids[-1, 0] = -2**31, 2**31 - 1
    expert_map = torch.randperm(e, device="cuda").to(torch.int32)
    expert_map[torch.randperm(e, device="cuda")[: e // 2]] = -1  # e == 1: the one expert stays local
    for bm in (1, 6, 32):
        _check(ids, e, bm, _run(ids, e, bm, expert_map), expert_map)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,bm", [(32, 8, 256, 32), (129, 9, 257, 16), (3000, 8, 64, 64)])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_sorted_ids_at_any_4_byte_offset(t, k, e, bm, offset):
    """The padding goes out in 16-byte stores where sorted_token_ids starts 16-byte aligned (4-byte ones
    up to and after them), in 4-byte stores otherwise: every offset gives the same outputs, and the words
    around the view stay as they were (both paths: 3000 x 8 pairs take the multi-block one)."""
    torch.manual_seed(t * 4 + offset)
    ids = _routing(t, k, e)
    mp = moe_sorting_max_padded(ids.numel(), e, bm)
    buf = poison(torch.empty(mp + 4, dtype=torch.int32, device="cuda"))
    out = (buf[offset:offset + mp], poison(torch.empty(mp // bm, dtype=torch.int32, device="cuda")),
           poison(torch.empty(1, dtype=torch.int32, device="cuda")))
    _check(ids, e, bm, hipkern.moe_sorting(ids, e, bm, out=out))
    outside = torch.cat([buf[:offset], buf[offset + mp:]])
    assert bool((outside == torch.iinfo(torch.int32).min).all()), "moe_sorting wrote outside sorted_token_ids"


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,bm", [(16384, 8, 256, 64), (65536, 2, 8, 128), (4096, 9, 257, 32),
                                      (131072, 8, 1024, 16), (1_000_003, 2, 64, 256)])
def test_many_tokens_multi_block(t, k, e, bm):
    torch.manual_seed(t)
    ids = _routing(t, k, e) if t * e <= 2**28 else torch.randint(0, e, (t, k), device="cuda", dtype=torch.int32)
    _check(ids, e, bm, _run(ids, e, bm))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 8), (100, 1), (3000, 8)])
def test_skewed_routing(t, k):
    e, bm = 256, 64
    same = torch.full((t, k), 17, device="cuda", dtype=torch.int32)  # every pair to one expert
    _check(same, e, bm, _run(same, e, bm))
    fixed = torch.arange(k, device="cuda", dtype=torch.int32).repeat(t, 1) * 3 + 5  # the same k experts
    _check(fixed, e, bm, _run(fixed, e, bm))
    res = _run(fixed, e, bm)
    used = (t + bm - 1) // bm * bm * k
    assert int(res[2]) == used and (res[1][: used // bm] >= 5).all() and (res[1][used // bm:] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e", [(1, 8, 256), (129, 8, 256), (20000, 8, 256), (300, 2, 9)])
@pytest.mark.parametrize("local_order", ["ascending", "permuted"])
def test_expert_map_with_half_the_experts_remote(t, k, e, local_order):
    """Half the experts local; their local ids ascending with the global ids, or a random permutation
    of them (blocks still follow the global expert order, each labelled with its local id)."""
    torch.manual_seed(t)
    ids = _routing(t, k, e)
    local = torch.randperm(e, device="cuda")[: e // 2]
    expert_map = torch.full((e,), -1, device="cuda", dtype=torch.int32)
    local_ids = torch.arange(e // 2, device="cuda", dtype=torch.int32)
    if local_order == "permuted":  # a random order that is never the ascending one
        local_ids = local_ids[torch.randperm(e // 2, device="cuda")]
        if torch.equal(local_ids, local_ids.sort().values):
            local_ids = local_ids.roll(1)
    expert_map[local.sort().values] = local_ids
    res = _run(ids, e, 32, expert_map)
    _check(ids, e, 32, res, expert_map)
    kept = res[0][res[0] < ids.numel()].long()
    assert (expert_map[ids.view(-1)[kept].long()] >= 0).all()
    assert int((expert_map[ids.view(-1).long()] >= 0).sum()) == kept.numel()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [5, 3000])
def test_out_of_range_ids_stay_in_bounds_and_validate_rejects_them(t):
    ids = _routing(t, 4, 64)
    ids[0, 0], ids[-1, 1], ids[t // 2, 2] = -5, 64, 2**31 - 1
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 64\)"):
        hipkern.moe_sorting(ids, 64, 16, validate=True)
    # Each output a view in the middle of a larger buffer: the words around it must stay as they were.
    mp, slack = moe_sorting_max_padded(ids.numel(), 64, 16), 4096
    bufs = [torch.full((n + 2 * slack,), 12345, device="cuda", dtype=torch.int32) for n in (mp, mp // 16, 1)]
    out = tuple(poison(b[slack:-slack]) for b in bufs)
    sorted_ids, expert_ids, num_post = hipkern.moe_sorting(ids, 64, 16, out=out)
    torch.cuda.synchronize()
    for b in bufs:
        assert bool((b[:slack] == 12345).all() and (b[-slack:] == 12345).all()), "a write outside an output"
    assert int(sorted_ids.min()) >= 0 and int(sorted_ids.max()) <= ids.numel()
    assert int(expert_ids.min()) >= -1 and int(expert_ids.max()) < 64
    assert 0 <= int(num_post) <= sorted_ids.numel()
    with pytest.raises(ValueError, match="expert_map values must be -1"):
        hipkern.moe_sorting(_routing(t, 4, 64), 64, 16, validate=True,
                            expert_map=torch.full((64,), -2, device="cuda", dtype=torch.int32))
    ok = _routing(t, 4, 64)
    _check(ok, 64, 16, hipkern.moe_sorting(ok, 64, 16, validate=True))
    past = torch.arange(64, device="cuda", dtype=torch.int32)
    past[7] = 64  # a local index is one of the E experts: 64 cannot be one
    with pytest.raises(ValueError,
                       match=r"expert_map values .* in \[0, 64\) \(num_experts\), found values in \[0, 64\]"):
        hipkern.moe_sorting(ok, 64, 16, validate=True, expert_map=past)
    past[7] = 63
    _check(ok, 64, 16, hipkern.moe_sorting(ok, 64, 16, validate=True, expert_map=past), past)


@pytest.mark.gpu
def test_largest_accepted_input_near_the_int32_limit():
    """The most pairs the op accepts at E = 1, block_m = 1 (T*k + E*block_m + 4096 = 2^31 - 1): the
    multi-block path's grid-stride loops over positions (stride ~ pairs / 8) must not wrap past 2^31.
    In 32 bits the tail loop's first position, total + first, wrapped negative for most threads and they
    wrote ~8 GiB before sorted_token_ids. ~26 GB of GPU memory."""
    n = 2**31 - 1 - 1 - 4096
    if torch.cuda.mem_get_info()[0] < 30 * 2**30:
        pytest.skip("needs ~30 GB of free GPU memory")
    ids = torch.zeros((n, 1), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="too many entries"):
        hipkern.moe_sorting(torch.empty((n + 1, 1), dtype=torch.int32, device="meta"), 1, 1)
    sorted_ids, expert_ids, num_post = _run(ids, 1, 1)
    torch.cuda.synchronize()
    assert int(num_post) == n
    assert sorted_ids.numel() == expert_ids.numel() == n
    chunk = 2**28
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        want = torch.arange(c0, c1, dtype=torch.int32, device="cuda")
        assert torch.equal(sorted_ids[c0:c1], want), f"sorted_token_ids wrong in [{c0}, {c1})"
        assert bool((expert_ids[c0:c1] == 0).all()), f"expert_ids wrong in [{c0}, {c1})"
        assert bool((ids.view(-1)[c0:c1] == 0).all()), f"topk_ids overwritten in [{c0}, {c1})"
    del sorted_ids, expert_ids, ids


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["topk_ids", "expert_map", "outputs"])
def test_outputs_overlapping_the_inputs_are_rejected(which):
    """The multi-block path re-reads the ids and the map while other blocks write the outputs: an
    overlap is refused before any launch (here at 8192 pairs, where sorted_token_ids is as long as the ids)."""
    e, bm = 1024, 1
    ids = _routing(8192, 1, e)
    emap = torch.arange(e, device="cuda", dtype=torch.int32)
    mp = moe_sorting_max_padded(ids.numel(), e, bm)
    out = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (mp, mp // bm, 1)]
    before = ids.clone()
    if which == "topk_ids":
        assert mp == ids.numel()
        out[0] = ids.view(-1)
        match = r"out\[0\] \(sorted_token_ids\) must not overlap topk_ids"
    elif which == "expert_map":
        big = torch.empty(mp // bm + e, dtype=torch.int32, device="cuda")
        out[1], emap = big[: mp // bm], big[mp // bm - 1:][:e]
        emap.copy_(torch.arange(e, device="cuda", dtype=torch.int32))
        match = r"out\[1\] \(expert_ids\) must not overlap expert_map"
    else:
        out[2] = out[1][:1]
        match = r"out\[1\] \(expert_ids\) must not overlap out\[2\]"
    with pytest.raises(ValueError, match=match):
        hipkern.moe_sorting(ids, e, bm, expert_map=emap, out=tuple(out))
    assert torch.equal(ids, before)


@pytest.mark.gpu
def test_zero_tokens():
    ids = torch.empty(0, 8, device="cuda", dtype=torch.int32)
    sorted_ids, expert_ids, num_post = _run(ids, 256, 64)
    assert sorted_ids.shape == (256 * 63 // 64 * 64,) and (sorted_ids == 0).all()
    assert (expert_ids == -1).all() and int(num_post) == 0
    s, x, n = hipkern.moe_sorting(torch.empty(0, 2, device="cuda", dtype=torch.int32), 8, 1)
    assert s.numel() == 0 and x.numel() == 0 and n.tolist() == [0]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 4096])  # one-block and multi-block paths
def test_deterministic(t):
    ids = torch.randint(0, 256, (t, 8), device="cuda", dtype=torch.int32)
    first = _run(ids, 256, 64)
    _check(ids, 256, 64, first)
    for _ in range(10):
        again = _run(ids, 256, 64)  # into poisoned outputs
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 4096])  # one-block and multi-block paths
def test_cuda_graph_capture_and_replay_with_new_ids(t):
    e, k, bm = 256, 8, 64
    ids = _routing(t, k, e)
    emap = torch.arange(e, device="cuda", dtype=torch.int32)
    emap[::3] = -1
    mp = moe_sorting_max_padded(t * k, e, bm)
    out = tuple(torch.empty(n, dtype=torch.int32, device="cuda") for n in (mp, mp // bm, 1))
    hipkern.moe_sorting(ids, e, bm, out=out)  # warm-up (module load) outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hipkern.moe_sorting(ids, e, bm, out=out)
        functional = hipkern.moe_sorting(ids, e, bm, expert_map=emap)
    for seed in range(3):
        torch.manual_seed(seed)
        ids.copy_(_routing(t, k, e))
        for o in (*out, *functional):
            poison(o)
        g.replay()
        torch.cuda.synchronize()
        _check(ids, e, bm, out)
        _check(ids, e, bm, functional, emap)


@pytest.mark.gpu
def test_torch_compile():
    def sort(ids):
        s, x, n = hipkern.moe_sorting(ids, 64, 16)
        return s + 0, x, n

    compiled = torch.compile(sort, fullgraph=True)
    for t in (16, 33):
        ids = _routing(t, 4, 64)
        compiled(ids)  # compiled; then the op's outputs from poisoned blocks
        poison_sorting_outputs(ids.device, t * 4, 64, 16)
        _check(ids, 64, 16, compiled(ids))


@pytest.mark.gpu
def test_validate_under_torch_compile():
    """validate=True reads the ids on the host: compiled code runs that check eagerly (a graph break) and still
    refuses a bad id; a full graph refuses validate=True with an error that says why and what to do."""
    def sort(ids):
        s, x, n = hipkern.moe_sorting(ids, 64, 16, validate=True)
        return s + 0, x, n

    torch._dynamo.reset()  # compiled code is cached by function: fullgraph=True below must trace afresh
    ids = _routing(16, 4, 64)
    _check(ids, 64, 16, torch.compile(sort)(ids))
    bad = ids.clone()
    bad[3, 1] = 64
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 64\)"):
        torch.compile(sort)(bad)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="validate=True reads values on the host"):
        torch.compile(sort, fullgraph=True)(ids)


@pytest.mark.gpu
def test_arguments_on_another_device_are_rejected():
    ids = _routing(4, 2, 8)
    with pytest.raises(ValueError, match="expert_map must be on cuda:0"):
        hipkern.moe_sorting(ids, 8, 4, expert_map=torch.zeros(8, dtype=torch.int32))
    mp = moe_sorting_max_padded(ids.numel(), 8, 4)
    with pytest.raises(ValueError, match=r"out\[0\] \(sorted_token_ids\) must be on cuda:0"):
        hipkern.moe_sorting(ids, 8, 4, out=tuple(torch.empty(n, dtype=torch.int32) for n in (mp, mp // 4, 1)))


# ---------------------------------------------------------------- argument validation (any device)
def _ids(t=4, k=2, e=8):
    return _routing(t, k, e, device="cpu")


@pytest.mark.parametrize("args,kwargs,match", [
    ((_ids(), 0, 16), {}, r"num_experts must be in \[1, 1024\]"),
    ((_ids(), 2000, 16), {}, r"num_experts must be in \[1, 1024\]"),
    ((_ids(), 8.0, 16), {}, "num_experts must be an int"),
    ((_ids(), 8, 0), {}, r"block_m must be in \[1, 1024\]"),
    ((_ids(), 8, 4096), {}, r"block_m must be in \[1, 1024\]"),
    ((_ids(), 8, True), {}, "block_m must be an int"),
    ((_ids().long(), 8, 16), {}, "topk_ids must be one of int32"),
    ((_ids().view(-1), 8, 16), {}, "topk_ids must have 2 dimensions"),
    ((_ids(8, 4).t(), 8, 16), {}, "topk_ids must be contiguous"),
    (([[1, 2]], 8, 16), {}, "topk_ids must be a torch.Tensor"),
    ((torch.empty(2**29, 4, dtype=torch.int32, device="meta"), 8, 16), {}, "topk_ids has too many entries"),
    ((_ids(), 8, 16), {"expert_map": torch.zeros(4, dtype=torch.int32)}, r"expert_map must have shape \(8,\)"),
    ((_ids(), 8, 16), {"expert_map": torch.zeros(8)}, "expert_map must be one of int32"),
    ((_ids(), 8, 16), {"validate": 1}, "validate must be a bool"),
    ((_ids(), 8, 16), {}, "topk_ids must be on a GPU"),
    ((_ids(), 8, 16), {"out": (torch.empty(128, dtype=torch.int32),)}, "out must be a triple"),
    ((_ids(), 8, 16), {"out": tuple(torch.empty(n, dtype=torch.int32) for n in (127, 8, 1))},
     r"out\[0\] \(sorted_token_ids\) must have shape \(128,\)"),
    ((_ids(), 8, 16), {"out": (torch.empty(128, dtype=torch.int32), torch.empty(8), torch.empty(1, dtype=torch.int32))},
     r"out\[1\] \(expert_ids\) must be one of int32"),
    ((_ids(), 8, 16), {"expert_map": torch.zeros(16, dtype=torch.int32)[::2]}, "expert_map must be contiguous"),
    ((_ids(), 8, 16), {"out": tuple(torch.empty(n, dtype=torch.int32) for n in (128, 8, 2))},
     r"out\[2\] \(num_tokens_post_padded\) must have shape \(1,\)"),
    ((_ids(), 8, 16), {"out": (torch.empty(256, dtype=torch.int32)[::2], torch.empty(8, dtype=torch.int32),
                               torch.empty(1, dtype=torch.int32))}, r"out\[0\] \(sorted_token_ids\) must be contiguous"),
])
def test_bad_arguments_raise_value_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hipkern.moe_sorting(*args, **kwargs)


def test_value_checks_refuse_ids_and_map_values_out_of_range_and_full_graphs():
    """validate=True's checks (CPU tensors here): ids in [0, E); map values in [-1, E), or [-1, num_local)."""
    from hipkern.ops.moe_sorting import _check_values
    ids = _ids()
    _check_values(ids, 8, torch.tensor([-1, 0, 1, 2, 3, 4, 5, 7], dtype=torch.int32))
    for v, bound in ((8, 8), (-2, 8)):
        with pytest.raises(ValueError, match=rf"expert_map values must be -1 \(remote\) .* \[0, {bound}\)"):
            _check_values(ids, 8, torch.tensor([v] + [0] * 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 4\) \(w1's first dim\), found values in \[0, 4\]"):
        _check_values(ids, 8, torch.tensor([4] + [0] * 7, dtype=torch.int32), 4, "w1's first dim")
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        _check_values(ids, 4, None)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="validate=True reads values on the host"):
        torch.compile(lambda t: _check_values(t, 8, None) or t + 1, fullgraph=True)(ids)


def test_importing_hipkern_does_not_load_dynamo():
    """host_check (validate=True's checks) breaks the graph itself instead of applying torch.compiler.disable, which
    loads dynamo when applied: ~2 s more to import hipkern."""
    import subprocess
    import sys
    probe = "import sys, hipkern; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_max_padded_is_sized_from_shapes():
    assert moe_sorting_max_padded(6, 4, 2) == 10
    assert moe_sorting_max_padded(8, 256, 64) == 16192
    assert moe_sorting_max_padded(0, 8, 1) == 0


def test_reference_on_a_hand_computed_case():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)  # pairs 0..5 -> experts 2 0 2 1 0 2
    s, x, n = moe_sorting_ref(ids, 4, 2)
    assert s.tolist() == [1, 4, 3, 6, 0, 2, 5, 6, 6, 6]  # expert 0: 1 4 | 1: 3 pad | 2: 0 2 5 pad | tail
    assert x.tolist() == [0, 1, 2, 2, -1] and n.tolist() == [8]
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32)  # experts 1 and 3 remote; 2 is local 1
    s, x, n = moe_sorting_ref(ids, 4, 2, emap)
    assert s.tolist() == [1, 4, 0, 2, 5, 6, 6, 6, 6, 6]
    assert x.tolist() == [0, 1, 1, -1, -1] and n.tolist() == [6]
    s, x, n = moe_sorting_ref(torch.empty(0, 2, dtype=torch.int32), 3, 4)
    assert s.tolist() == [0] * 12 and x.tolist() == [-1] * 3 and n.tolist() == [0]


def test_op_is_registered_for_compile_and_graphs():
    assert hasattr(torch.ops.hipkern, "moe_sorting") and hasattr(torch.ops.hipkern, "moe_sorting_out")
    schema = str(torch.ops.hipkern.moe_sorting_out.default._schema)
    assert "Tensor(a!) sorted_token_ids" in schema and "Tensor(c!) num_tokens_post_padded" in schema


def test_fake_impl_gives_the_output_shapes_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.empty(5, 8, device="cuda", dtype=torch.int32)
        s, x, n = torch.ops.hipkern.moe_sorting(ids, 256, 64, None)
        assert s.shape == (16192,) and x.shape == (253,) and n.shape == (1,)
        assert s.dtype == x.dtype == n.dtype == torch.int32
        with pytest.raises(ValueError, match="block_m must be in"):
            torch.ops.hipkern.moe_sorting(ids, 256, 0, None)


@pytest.mark.gpu
def test_direct_op_calls_are_validated_before_any_launch():
    ids = _routing(64, 8, 256)
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, 1024\]"):
        torch.ops.hipkern.moe_sorting(ids, 0, 16, None)
    with pytest.raises(ValueError, match=r"expert_map must have shape \(256,\)"):
        torch.ops.hipkern.moe_sorting(ids, 256, 16, torch.zeros(8, dtype=torch.int32, device="cuda"))
    small = [torch.full((n,), 7, dtype=torch.int32, device="cuda") for n in (16, 1, 1)]
    with pytest.raises(ValueError, match=r"out\[0\] \(sorted_token_ids\) must have shape"):
        torch.ops.hipkern.moe_sorting_out(ids, 256, 16, None, *small)
    torch.cuda.synchronize()
    assert all(bool((t == 7).all()) for t in small)


@pytest.mark.gpu
def test_lazy_id_views_are_refused_on_the_fast_path():
    """The argument check's fast path (a contiguous int32 CUDA tensor, nothing else given) refuses a lazily negated
    or zero tensor as the full check does: its bytes are not its values."""
    ids = torch.randint(0, 8, (4, 2), dtype=torch.int32, device="cuda")
    for lazy in (torch._neg_view(ids), torch._efficientzerotensor((4, 2), dtype=torch.int32, device="cuda")):
        with pytest.raises(ValueError, match="topk_ids must hold its values in memory"):
            hipkern.moe_sorting(lazy, 8, 4)
