"""_common.validated, the ops' memo of argument sets that passed their validation (CPU test): a repeated set skips
the check; any tensor metadata or scalar (with its type) that differs is checked again; a failed check is not
remembered; other tensor and scalar types, and bounded caches, are checked in full."""
import pytest
import torch

from hipkern.ops import _common
from hipkern.ops._common import validated


class Check:
    """A validation that counts its calls and refuses a scale of True or a non-contiguous tensor."""

    def __init__(self):
        self.calls = 0

    def __call__(self, t, scale, name):
        self.calls += 1
        if scale is True or not t.is_contiguous():
            raise ValueError("bad argument")


def run(cache, check, t, scale=1.0, name="x", other=None):
    validated(cache, check, (t, other), (scale, name), t, scale, name)


def test_a_repeated_set_skips_the_check_and_any_difference_checks_again():
    cache, check, t = {}, Check(), torch.randn(4, 6)
    run(cache, check, t)
    run(cache, check, t)
    run(cache, check, torch.randn(4, 6))  # another tensor of the same metadata: the check reads only that
    assert check.calls == 1
    differing = [dict(t=torch.randn(4, 7)), dict(t=torch.randn(4, 6, dtype=torch.float64)),
                 dict(t=torch.empty(4, 6, device="meta")), dict(scale=2.0), dict(scale=1), dict(name="y"),
                 dict(other=torch.zeros(3))]
    for i, change in enumerate(differing):
        run(cache, check, **{"t": t, **change})
        assert check.calls == 2 + i, change
    assert len(cache) == 1 + len(differing)


def test_a_failed_check_is_not_remembered():
    cache, check, t = {}, Check(), torch.randn(4, 6)
    run(cache, check, t, scale=1)
    for _ in range(2):  # True == 1 and hash(True) == hash(1): the key's types keep them apart
        with pytest.raises(ValueError):
            run(cache, check, t, scale=True)
    strided = torch.randn(4, 12)[:, ::2]  # t's shape, dtype and device; other strides
    for _ in range(2):
        with pytest.raises(ValueError):
            run(cache, check, strided, scale=1)
    assert check.calls == 5 and len(cache) == 1


def test_other_types_are_checked_every_time():
    cache, check, t = {}, Check(), torch.randn(4, 6)

    class Sub(torch.Tensor):
        pass

    sub = t.as_subclass(Sub)
    for _ in range(2):
        run(cache, check, sub)
        run(cache, check, t, scale=[1.0])  # unhashable: the check, not a TypeError, says what is wrong
    assert check.calls == 4 and not cache


def test_a_sparse_tensor_is_not_taken_for_a_dense_one_of_its_shape_and_strides():
    cache, check = {}, Check()
    dense = torch.tensor(5, dtype=torch.int32).expand(1)  # shape (1,), strides (0,): contiguous
    sparse = torch.tensor([5], dtype=torch.int32).to_sparse()
    assert sparse.shape == dense.shape and sparse.dtype == dense.dtype and sparse.device == dense.device
    run(cache, check, dense)
    with pytest.raises((ValueError, RuntimeError)):  # refused by the check (or by torch), never a cached pass
        run(cache, check, sparse)
    assert check.calls == 2


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_common, "MEMO_LIMIT", 3)
    cache, check, t = {}, Check(), torch.randn(2)
    for s in range(7):
        run(cache, check, t, scale=float(s))
    assert check.calls == 7 and 1 <= len(cache) <= 3


def test_lazy_views_are_refused_and_never_taken_from_the_memo():
    """A lazily negated view (as `.conj().imag` gives) or a zero tensor has the shape, strides and dtype of a good
    argument, but its bytes are not its values (a zero tensor has none): the kernels read bytes. check_tensor
    refuses it by name, and validated does not take it for the good argument it passed before."""
    good = torch.randn(4, 6)
    cache, calls = {}, []

    def check(t):
        calls.append(t)
        _common.check_tensor("gating_logits", t, ndim=2, gpu=False)

    validated(cache, check, (good,), (), good)
    for lazy in (torch._neg_view(good), torch._efficientzerotensor((4, 6))):
        assert lazy.shape == good.shape and lazy.stride() == good.stride() and lazy.dtype == good.dtype
        with pytest.raises(ValueError, match="gating_logits must hold its values in memory"):
            validated(cache, check, (lazy,), (), lazy)
    assert len(calls) == 3
    one = torch.randn(1, 1, dtype=torch.complex64).conj().imag  # public: a contiguous negated view
    assert one.is_neg() and one.is_contiguous()
    with pytest.raises(ValueError, match="x must hold its values"):
        _common.check_tensor("x", one, gpu=False)


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested and CSR tensors are prototype / beta
def test_non_strided_tensors_are_refused_by_name():
    for t, kind in ((torch.nested.nested_tensor([torch.zeros(16)] * 2), "a nested tensor"),
                    (torch.zeros(4, 8).to_sparse_csr(), "torch.sparse_csr tensor"),
                    (torch.zeros(4, 8).to_sparse(), "torch.sparse_coo tensor")):
        with pytest.raises(ValueError, match=f"logits must be a dense \\(strided\\) tensor, got {kind}"):
            _common.check_tensor("logits", t, ndim=2, gpu=False)


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested and CSR tensors are prototype / beta
def test_the_routing_ops_fast_paths_take_only_plain_tensors(monkeypatch):
    """Each routing op's argument fast path (a contiguous GPU tensor of the right dtype, nothing else given) leaves
    lazily negated or zero views and non-strided tensors to check_tensor, which refuses them by name (a negated view
    was ranked by its bytes, a nested one raised a torch RuntimeError). Run on the CPU with tensors that say they are
    on a GPU: the fast paths' own test."""
    from hipkern.ops import grouped_topk as GT, moe_sorting as MS, topk_softmax as TS

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, ids = torch.randn(4, 8), torch.randint(0, 8, (4, 2), dtype=torch.int32)
    TS._validate(x, 2, True)  # plain ones take the fast path (no device check fails)
    GT._validate(x, torch.zeros(8), 2, 2, 1, "sigmoid", True, 1.0, "top2")
    MS._validate(ids, 8, 4, None)
    lazy = lambda t: (torch._neg_view(t), torch._efficientzerotensor(t.shape, dtype=t.dtype))
    for bad in lazy(x):
        with pytest.raises(ValueError, match="gating_logits must hold its values in memory"):
            TS._validate(bad, 2, True)
        with pytest.raises(ValueError, match="gating_logits must hold its values in memory"):
            GT._validate(bad, None, 2, 2, 1, "sigmoid", True, 1.0, "top2")
    for bad in lazy(torch.zeros(8)):
        with pytest.raises(ValueError, match="correction_bias must hold its values in memory"):
            GT._validate(x, bad, 2, 2, 1, "sigmoid", True, 1.0, "top2")
    for bad in lazy(ids):
        with pytest.raises(ValueError, match="topk_ids must hold its values in memory"):
            MS._validate(bad, 8, 4, None)
    for bad in (torch.nested.nested_tensor([torch.zeros(8)] * 2), x.to_sparse_csr()):
        with pytest.raises(ValueError, match="gating_logits must be a dense"):
            TS._validate(bad, 2, True)


def test_addresses_not_aligned_to_elements_are_refused_at_launch():
    """A view into a byte buffer at an odd offset passes every check of shapes and strides, but the kernels cannot
    load or store its elements: the routing ops' launches refuse it by name before anything runs."""
    from hipkern.ops import grouped_topk as GT, moe_sorting as MS, topk_softmax as TS

    x = torch.frombuffer(bytearray(200), dtype=torch.float32, offset=1, count=32).view(4, 8)
    ids = torch.frombuffer(bytearray(200), dtype=torch.int32, offset=2, count=8).view(4, 2)
    assert x.data_ptr() % 4 and ids.data_ptr() % 4
    w, i = torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="gating_logits must start at an address aligned to its 4-byte elements"):
        TS._launch(x, 2, True, w, i)
    with pytest.raises(ValueError, match="gating_logits must start at an address aligned"):
        GT._launch(x, None, 2, 1, 1, "sigmoid", True, 1.0, "top2", w, i)
    with pytest.raises(ValueError, match="topk_ids must start at an address aligned to its 4-byte elements"):
        MS._run(ids, 8, 4, None, *MS._outputs(torch.zeros(4, 2, dtype=torch.int32), 8, 4))
    _common.check_aligned(a=torch.randn(8)[1:], b=None)  # an element offset is fine


def test_fused_moe_and_paged_attention_refuse_small_inputs_not_aligned_to_elements(monkeypatch):
    """fused_moe's routing inputs (which it sorts itself, past moe_sorting's own launch check) and paged
    attention's query, tables and lengths: refused by name at launch, before anything runs."""
    from hipkern.ops import fused_moe as FM, paged_attention as PA

    monkeypatch.setattr(FM, "on_device", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(PA, "module_for", lambda *a, **k: pytest.fail("launched"))
    odd = lambda n, dt, at: torch.frombuffer(bytearray(4 * n + 8), dtype=dt, offset=at, count=n)
    x, w1, w2 = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 64, dtype=torch.bfloat16), \
        torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    tw, ids = torch.full((4, 2), 0.5), torch.zeros(4, 2, dtype=torch.int32)
    for name, args in (("topk_weights", (odd(8, torch.float32, 2).view(4, 2), ids, None)),
                       ("topk_ids", (tw, odd(8, torch.int32, 1).view(4, 2), None)),
                       ("expert_map", (tw, ids, odd(8, torch.int32, 3)))):
        with pytest.raises(ValueError, match=f"{name} must start at an address aligned to its 4-byte elements"):
            FM._launch(x, w1, w2, args[0], args[1], "silu", args[2], 0, "", torch.empty_like(x))
    q, kv = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    bt, cl, lse = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.empty(2, 4)
    for name, args in (("query", (odd(512, torch.bfloat16, 1).view(2, 4, 64), bt, cl, lse)),
                       ("block_tables", (q, odd(6, torch.int32, 2).view(2, 3), cl, lse)),
                       ("context_lens", (q, bt, odd(2, torch.int32, 1), lse)),
                       ("lse", (q, bt, cl, odd(8, torch.float32, 2).view(2, 4)))):
        with pytest.raises(ValueError, match=f"{name} must start at an address aligned to its"):
            PA._launch_here(args[0], kv, kv, args[1], args[2], 0.1, "NHD", "", torch.empty_like(q), args[3])


def test_check_tensor_traces_under_torch_compile_fullgraph():
    """The ops validate inside their Python wrappers, which torch.compile traces: dynamo cannot ask a tensor for
    its lazy bits (is_neg, _is_zerotensor), so check_tensor leaves that to the untraced fake and real
    implementations of the registered ops; the rest traces without a graph break."""
    def f(x):
        _common.check_tensor("x", x, ndim=2, gpu=False)
        return x * 2

    x = torch.randn(4, 8)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), x * 2)
