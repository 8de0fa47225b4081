"""The routing ops in tests/fuzz.py's sweep (topk_softmax, grouped_topk, moe_sorting; what is drawn: fuzz.py).

Per op: draw, run, validate (the op's argument checks on meta tensors, and the values drawn: inputs come from the
case seed on the CPU, so --dry-run builds what a GPU run gets), judged as the ops' tests judge them.
"""
import importlib
import math

import torch

import hipkern
from hipkern.reference import grouped_topk_ref, grouped_topk_scores_ref, moe_sorting_ref, topk_softmax_ref
from hipkern.testing import checkAllclose, poison, poison_next_alloc
# (tests/ is on sys.path: fuzz.py's directory)
from test_grouped_topk import (ATOL as GT_ATOL, CONFIGS as GT_CONFIGS, RTOL as GT_RTOL, _check_near_rows, _near,
                               _noise)
from test_topk_softmax import ATOL as TS_ATOL, RTOL as TS_RTOL

TS, GT, MS = (importlib.import_module(f"hipkern.ops.{m}") for m in ("topk_softmax", "grouped_topk", "moe_sorting"))
DEVICE = "cuda"  # of the runs' tensors
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GUARD = 4  # poisoned elements after each out= view
# float32 outputs are poisoned with a NaN of this payload (no GPU computes it: their NaNs are 0x7FFFFFFF or
# 0x7FC00000), so an element left unwritten shows where the right value is NaN too (grouped_topk's renormalised
# weights of a row whose chosen scores are all 0), which checkAllclose's equal NaNs would pass
POISON_BITS = 0x7FF0DEAD
# Logits: N(0, scale^2), or many exact ties (equal logits go to the lower expert in the ops and the references
# alike): a few values (-0.0 and 0.0 among them), multiples of 1/4, rows of one value; or some -inf.
VALUES = ("randn", "randn", "randn", "few", "grid", "equal_rows", "neg_inf")
FEW = (0.0, -0.0, 1.0, 2.0, -1.5)
SCALES = (0.5, 1.0, 2.0, 2.0, 4.0)
SCALINGS = (1.0, 1.0, 1.0, 2.5, 16.0, 0.5, 0.0, -1.0)  # grouped_topk's routed_scaling_factor (or a random one)
# The tests' expert counts (the launchers' vector and scalar paths, lanes a row) and the limits.
TS_EXPERTS = (1, 2, 3, 4, 5, 8, 16, 20, 24, 32, 60, 64, 100, 128, 130, 160, 200, 250, 256, 257, 384, 511, 512)
SORT_EXPERTS = (1, 2, 3, 8, 64, 255, 256, 257, 300, 384, 1000, 1023, 1024)
PAIR_EDGES = (255, 256, 257, 2047, 2048, 2049, 4095, 4096, 4097, 6145, 8193)  # moe_sorting's kernels' bounds
BLOCK_MS = (1, 2, 3, 5, 6, 8, 16, 16, 32, 32, 48, 64, 64, 100, 128, 256, 1024)
SORT_ROUTINGS = ("distinct", "distinct", "uniform", "same", "fixed", "few", "half_empty", "skew")
MAX_PAIRS = 200_000  # moe_sorting_ref loops over the experts on the CPU
BUCKETS = dict(tokens=(0, 1, 64, 4096, 20000), experts=(1, 8, 64, 256, 257, 512, 1023, 1024), groups=(1, 2, 8, 63, 64),
               topk=(1, 2, 8, 15, 16, 64), topk_group=(1, 2, 8, 64), block_m=(1, 16, 64, 128, 1024))  # for --dry-run


# ------------------------------------------------------------------------------------------ shared parts
def bucket(n, edges):
    return next((f"<={e}" for e in edges if n <= e), f">{edges[-1]}")


def draw_tokens(rng):
    """0, 1, a block edge, a few, up to 4096, sometimes 4097..20000."""
    r = rng.random()
    if r < 0.15:
        return 0 if r < 0.06 else 1
    if r < 0.25:
        return rng.choice((2, 3, 7, 8, 31, 32, 33, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025))
    return rng.randint(2, 64) if r < 0.5 else rng.randint(65, 4096) if r < 0.9 else rng.randint(4097, 20000)


def draw_k(rng, hi):
    return 1 if (r := rng.random()) < 0.15 else hi if r < 0.35 else rng.randint(1, hi)


def draw_values(rng):
    v = rng.choice(VALUES)
    return dict(values=v, scale=rng.choice(SCALES), few=FEW[:rng.randint(2, len(FEW))] if v == "few" else None,
                inf_share=rng.choice((0.1, 0.5, 0.9)) if v == "neg_inf" else None)


def draw_unaligned(rng, names):
    """Some of the case's tensors 1..3 elements into their buffers (contiguous, not 16-byte aligned)."""
    unaligned = sorted(rng.sample(names, rng.randint(1, len(names)))) if rng.random() < 0.25 else []
    return dict(unaligned=unaligned, shift=rng.randint(1, 3) if unaligned else 0)


def logits(c, g):
    """[T, E] in the case's dtype, on the CPU; never NaN, a finite logit in every row."""
    t, e = c["tokens"], c["experts"]
    x = torch.randn(t, e, generator=g) * c["scale"]
    if c["values"] == "few":
        x = torch.tensor(c["few"])[torch.randint(0, len(c["few"]), (t, e), generator=g)]
    elif c["values"] == "grid":
        x = (x * 4).round() / 4
    elif c["values"] == "equal_rows":  # ~30 % of the rows
        rows = torch.rand(t, generator=g) < 0.3
        x[rows] = x[rows, :1]
    elif c["values"] == "neg_inf":
        x[torch.rand(t, e, generator=g) < c["inf_share"]] = -math.inf
        x[torch.arange(t), torch.randint(0, e, (t,), generator=g)] = torch.randn(t, generator=g) * c["scale"]
    assert not x.isnan().any() and (t == 0 or (x.amax(dim=1) > -math.inf).all())
    return x.to(DT[c["dtype"]])


def placed(shape, dtype, shift, values=None):
    """(view, buffer): a `shape` view (holding `values`) `shift` elements into a poisoned buffer, GUARD after it."""
    n = math.prod(shape)
    buf = _poisoned(torch.empty(shift + n + GUARD, dtype=dtype, device=DEVICE))
    view = buf[shift:shift + n].view(shape)
    return (view if values is None else view.copy_(values)), buf


def _poisoned(t):
    """poison(t), float32 with the NaN of POISON_BITS."""
    return t.view(torch.int32).fill_(POISON_BITS).view(t.dtype) if t.dtype == torch.float32 else poison(t)


def same_bits(a, b) -> bool:
    """Whether two tensors (of one shape and dtype, rows contiguous) hold the same bytes (NaN and -0.0 as well)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def unwritten(t) -> bool:
    """Whether float32 `t` still holds the poison's NaN somewhere."""
    return t.dtype == torch.float32 and bool((t.view(torch.int32) == POISON_BITS).any())



def placed_input(c, name, t):  # on the GPU, unaligned if so drawn
    return None if t is None else placed(t.shape, t.dtype, c["shift"] * (name in c["unaligned"]), t.to(DEVICE))[0]


def out_specs(c):  # (shape, dtype) of each output: weights and ids, or moe_sorting's three
    if "block_m" not in c:
        return [((c["tokens"], c["topk"]), torch.float32), ((c["tokens"], c["topk"]), torch.int32)]
    mp = MS.moe_sorting_max_padded(c["tokens"] * c["topk"], c["experts"], c["block_m"])
    return [((mp,), torch.int32), ((mp // c["block_m"],), torch.int32), ((1,), torch.int32)]


def run_checked(c, attempt, op, args, kw, judge):
    """One run: op(*args, **kw, out=) into poisoned views with poisoned guards after them, `judge`(*outputs) ->
    (mismatch share, problems); then the guards still poisoned, and the functional form the same bits."""
    specs = out_specs(c)
    outs = [placed(shape, dt, c["shift"] * ("out" in c["unaligned"])) for shape, dt in specs]
    views = tuple(v for v, _ in outs)
    inputs = [(a, a.clone()) for a in (*args, *kw.values()) if torch.is_tensor(a)]  # (the judge reads them after)

    def check(got):
        if any(a is not b for a, b in zip(got, views)):
            return 1.0, "the result is not out="
        if not all(same_bits(a, b) for a, b in inputs):
            return 1.0, "the op changed an input"
        share, msgs = judge(*views)
        if any(unwritten(v) for v in views):
            msgs.append("an element of out= left unwritten (the poison's NaN)")
        for view, buf in outs:
            s = view.storage_offset()
            rest = torch.cat((buf[:s], buf[s + view.numel():]))
            if not (rest.isnan() if rest.is_floating_point() else rest == torch.iinfo(rest.dtype).min).all():
                msgs.append("a write outside out= (into the guard elements)")
        poison_next_alloc(views[0].device, *specs, fill=_poisoned)
        again = op(*args, **kw)
        if any(unwritten(a) for a in again):
            msgs.append("an element of the functional call's output left unwritten (the poison's NaN)")
        if not all(same_bits(a, b) for a, b in zip(views, again)):
            msgs.append("the same call again (functional) gives other bits (not deterministic)")
        return share, "; ".join(msgs)

    return [dict(variant=None, **attempt(lambda: op(*args, **kw, out=views), check))]


def verdicts(c, verdict, checks, *args):
    """The op's argument checks, `checks`(*args, out), with out= (meta tensors) and without."""
    out = tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in out_specs(c))
    return [verdict(checks, *args, out), verdict(checks, *args)]


def features(c):
    """What --dry-run counts: the case's choices (numbers in buckets) and a few derived ones."""
    f = {k: ",".join(v) if isinstance(v, list) else bucket(v, BUCKETS[k]) if k in BUCKETS else v
         for k, v in c.items() if k not in ("few", "inf_share", "shift", "mb", "remote_share")}
    if "block_m" in c:
        return dict(f, pairs=bucket(c["tokens"] * c["topk"], (0, 256, 4096, 8192, MAX_PAIRS)))
    per, tg = c["experts"] // c.get("groups", 1), c.get("topk_group", 1)
    f.update(topk_max=c["topk"] == min(16, tg * per))
    if "groups" in c:
        f.update(per_group=bucket(per, (1, 2, 8, 32, 512)), all_groups_kept=tg == c["groups"],
                 scaling=c["scaling"] if c["scaling"] in SCALINGS else "random")
    return f


# -------------------------------------------------------------------------------------------- topk_softmax
def draw_topk(rng):
    e = rng.choice(TS_EXPERTS) if rng.random() < 0.6 else rng.randint(1, TS.MAX_EXPERTS)
    c = dict(dtype=rng.choice(sorted(DT)), tokens=draw_tokens(rng), experts=e, topk=draw_k(rng, min(TS.MAX_TOPK, e)),
             renormalize=rng.random() < 0.6, **draw_values(rng), **draw_unaligned(rng, ["logits", "out"]))
    return dict(c, mb=round(c["tokens"] * e * DT[c["dtype"]].itemsize / 2**20, 1))


def run_topk(c, seed, verbose, attempt):
    x = placed_input(c, "logits", logits(c, torch.Generator().manual_seed(seed)))

    def judge(w, ids):
        """As test_topk_softmax: the ids exactly the reference's (the op ranks the logits themselves, equal ones to
        the lower expert; "+ 0.0" makes -0.0 a 0.0 for the reference's sort, equal to it as for the op), the
        weights within the test's tolerance."""
        ref_w, ref_ids = topk_softmax_ref(x + 0.0, c["topk"], c["renormalize"])
        return max(checkAllclose(w, ref_w, rtol=TS_RTOL, atol=TS_ATOL, msg="weights ", printLog=verbose),
                   checkAllclose(ids, ref_ids, rtol=0, atol=0, msg="ids ", printLog=verbose)), []

    return run_checked(c, attempt, hipkern.topk_softmax, (x, c["topk"], c["renormalize"]), {}, judge)


def validate_topk(c, seed, verdict):
    x = logits(c, torch.Generator().manual_seed(seed))
    return verdicts(c, verdict, TS._validate, x.to("meta"), c["topk"], c["renormalize"])


# -------------------------------------------------------------------------------------------- grouped_topk
def draw_grouped(rng):
    r = rng.random()
    if r < 0.3:
        e, g, tg = rng.choice(GT_CONFIGS)
    else:  # groups 1..64 of 1..512/groups experts: non-powers of two, one expert a group, E = 1 and 512
        g = rng.choice((1, 1, 2, 3, 4, 5, 6, 8, 8, 16, 32, 64)) if r < 0.8 else rng.randint(1, GT.MAX_GROUPS)
        most = GT.MAX_EXPERTS // g
        per = min(most, rng.choice((1, 2, 3, 4, 8, 16, 32, most))) if rng.random() < 0.6 else rng.randint(1, most)
        e, tg = g * per, rng.randint(1, g)
    bias = rng.choice((None, "randn", "randn", "eighths"))
    c = dict(dtype=rng.choice(sorted(DT)), tokens=draw_tokens(rng), experts=e, groups=g, topk_group=tg,
             topk=draw_k(rng, min(GT.MAX_TOPK, tg * (e // g))), scoring=rng.choice(sorted(GT.SCORINGS)),
             group_scoring=rng.choice(sorted(GT.GROUP_SCORINGS)), bias=bias, renormalize=rng.random() < 0.6,
             scaling=rng.choice(SCALINGS + (round(rng.uniform(0.01, 10.0), 4),)), **draw_values(rng),
             **draw_unaligned(rng, ["logits", "out"] + ["bias"] * (bias is not None)))
    return dict(c, mb=round(c["tokens"] * e * DT[c["dtype"]].itemsize / 2**20, 1))


def grouped_inputs(c, g):
    """(logits, bias float32 [E] or None) on the CPU; "eighths": multiples of 1/8, exact ties of b = s + bias."""
    x, e = logits(c, g), c["experts"]
    if c["bias"] is None:
        return x, None
    return x, torch.randn(e, generator=g) * 0.3 if c["bias"] == "randn" else torch.randint(0, 4, (e,), generator=g) / 8


def tied_edge(v, n):
    """Rows of `v` (sorted, descending) tied exactly across their n-th place with another value within float32
    noise of the tie: float32 may rank it among the tied (_near sees consecutive gaps only)."""
    if n >= v.shape[1]:
        return torch.zeros(v.shape[0], dtype=torch.bool, device=v.device)
    d = (v - v[:, n - 1:n]).abs()
    return (v[:, n] == v[:, n - 1]) & ((d > 0) & (d < _noise(v[:, n - 1:n]))).any(dim=1)


def near_ties(c, b, gs):
    """Rows whose choice float32 noise may change: test_grouped_topk._check's, and what its inputs lack: tied_edge,
    and groups tied by equal sums of different pairs (tie-heavy logits, a bias in 1/8s), which float32 may part."""
    (t, e), g, tg, k = b.shape, c["groups"], c["topk_group"], c["topk"]
    near = torch.zeros(t, dtype=torch.bool, device=b.device)
    if tg < g:
        ordered = gs.sort(dim=1, descending=True).values
        near |= _near(ordered[:, tg - 1:], 1) | tied_edge(ordered, tg)
        if c["group_scoring"] == "top2":
            pairs = b.view(t, g, e // g).topk(min(2, e // g), dim=-1).values
            tied = (gs == ordered[:, tg - 1:tg]).unsqueeze(-1)
            apart = pairs.masked_fill(~tied, -math.inf).amax(dim=1) != pairs.masked_fill(~tied, math.inf).amin(dim=1)
            near |= (ordered[:, tg] == ordered[:, tg - 1]) & apart.any(dim=1)
    kept = torch.zeros(t, g, dtype=torch.bool, device=b.device)
    kept.scatter_(1, gs.sort(dim=1, descending=True, stable=True).indices[:, :tg], True)
    ranked = b.masked_fill(~kept.repeat_interleave(e // g, dim=1), -math.inf).sort(dim=1, descending=True).values
    return near | _near(ranked, min(k, tg * (e // g) - 1)) | tied_edge(ranked, k)


def judge_grouped(c, x, bias, w, ids, verbose):
    """test_grouped_topk._check's judgement, without its bound on the share of rows with a near-tie (few in the
    test's inputs; sigmoid scores of large logits crowd within float32 noise): the weights are the scores at
    the returned ids; the ids are the float64 reference's in every row without a near-tie (exact ties follow the
    index rule on both sides), and in the others a top-k that float32 noise allows (_check_near_rows)."""
    (t, e), g, tg, k = x.shape, c["groups"], c["topk_group"], c["topk"]
    s, b, gs = grouped_topk_scores_ref(x, bias, g, c["scoring"], group_scoring=c["group_scoring"])
    ref_ids = grouped_topk_ref(x, bias, k, g, tg, c["scoring"], group_scoring=c["group_scoring"])[1]
    if t and (int(ids.min()) < 0 or int(ids.max()) >= e or (ids.sort(dim=1).values.diff(dim=1) == 0).any()):
        return 1.0, ["an id out of range or an expert chosen twice (unwritten?)"]
    picked = s.gather(1, ids.long())
    picked = picked / picked.sum(dim=1, keepdim=True) if c["renormalize"] else picked
    share = checkAllclose(w, (picked * c["scaling"]).float(), rtol=GT_RTOL, atol=GT_ATOL, msg="weights at ids ",
                          printLog=verbose)
    near = near_ties(c, b, gs)
    share = max(share, checkAllclose(ids[~near], ref_ids[~near], rtol=0, atol=0, msg="ids ", printLog=verbose))
    try:
        if near.any():
            _check_near_rows(b[near], gs[near], ids[near].long(), k, g, tg)
    except AssertionError as err:
        return max(share, float(near.float().mean())), [f"a row with a near-tie: {err}"]
    return share, []


def run_grouped(c, seed, verbose, attempt):
    x, bias = grouped_inputs(c, torch.Generator().manual_seed(seed))
    x, bias = placed_input(c, "logits", x), placed_input(c, "bias", bias)
    kw = dict(scoring=c["scoring"], renormalize=c["renormalize"], routed_scaling_factor=c["scaling"],
              group_scoring=c["group_scoring"])
    return run_checked(c, attempt, hipkern.grouped_topk, (x, bias, c["topk"], c["groups"], c["topk_group"]), kw,
                       lambda w, ids: judge_grouped(c, x, bias, w, ids, verbose))


def validate_grouped(c, seed, verdict):
    x, bias = grouped_inputs(c, torch.Generator().manual_seed(seed))
    return verdicts(c, verdict, GT._validate, x.to("meta"), None if bias is None else bias.to("meta"), c["topk"],
                    c["groups"], c["topk_group"], c["scoring"], c["renormalize"], c["scaling"], c["group_scoring"])


# --------------------------------------------------------------------------------------------- moe_sorting
def draw_sort(rng):
    e = rng.choice(SORT_EXPERTS) if rng.random() < 0.6 else rng.randint(1, MS.MAX_EXPERTS)
    routing = rng.choice(SORT_ROUTINGS)
    if rng.random() < 0.15:  # pairs at the bounds of the one-step, one-block and multi-block kernels
        k, t = 1, rng.choice(PAIR_EDGES)
    else:  # (moe_sorting has no bound on k: sometimes more than a router gives)
        k, t = draw_k(rng, 16) if rng.random() < 0.9 else rng.randint(17, 64), draw_tokens(rng)
    if routing == "distinct":  # distinct experts per token, as a router gives
        k, t = min(k, e), min(t, 2**23 // e)
    t = min(t, MAX_PAIRS // k)
    bm = rng.choice(BLOCK_MS) if rng.random() < 0.7 else rng.randint(1, MS.MAX_BLOCK_M)
    emap = rng.choice((None, None, None, "permuted", "permuted", "ascending", "all_remote"))
    c = dict(tokens=t, topk=k, experts=e, block_m=bm, routing=routing, expert_map=emap,
             remote_share=rng.choice((0.0, 0.5, 0.5, 0.9, round(rng.random(), 3))) if emap in ("permuted", "ascending")
             else None, validate=rng.random() < 0.3,
             **draw_unaligned(rng, ["ids", "out"] + ["expert_map"] * (emap is not None)))
    return dict(c, mb=round((t * k + MS.moe_sorting_max_padded(t * k, e, bm)) * 4 / 2**20, 1))


def sort_inputs(c, g):
    """(topk_ids int32 [T, k], expert_map int32 [E] or None) on the CPU, every id in [0, E)."""
    t, k, e, routing = c["tokens"], c["topk"], c["experts"], c["routing"]
    perm = torch.randperm(e, generator=g)
    if routing == "distinct":
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    elif routing == "same":  # every pair on one expert
        ids = perm[:1].expand(t, k)
    elif routing == "fixed":  # the same k experts (repeats if k > E) for every token
        ids = perm[torch.arange(k) % e].expand(t, k)
    else:  # from 3 experts, from half of them, 80 % on one, or uniform (repeats within a token)
        pool = perm[:3] if routing == "few" else perm[:max(1, e // 2)] if routing == "half_empty" else perm
        ids = pool[torch.randint(0, pool.numel(), (t, k), generator=g)]
        if routing == "skew":
            ids[torch.rand(t, k, generator=g) < 0.8] = int(perm[0])
    emap = None
    if c["expert_map"] is not None:  # local experts (local ids ascending or permuted), the others -1 (remote)
        n_local = 0 if c["expert_map"] == "all_remote" else e - round(e * c["remote_share"])
        local = torch.randperm(e, generator=g)[:n_local].sort().values
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[local] = (torch.arange(n_local) if c["expert_map"] == "ascending" else
                       torch.randperm(n_local, generator=g)).to(torch.int32)
    return ids.to(torch.int32).contiguous(), emap


def run_sort(c, seed, verbose, attempt):
    ids, emap = sort_inputs(c, torch.Generator().manual_seed(seed))
    ids, emap = placed_input(c, "ids", ids), placed_input(c, "expert_map", emap)

    def judge(*got):  # as test_moe_sorting: the three outputs exactly the reference's, every element
        ref = moe_sorting_ref(ids, c["experts"], c["block_m"], emap)
        return max(checkAllclose(a, b, rtol=0, atol=0, msg=name, printLog=verbose)
                   for a, b, name in zip(got, ref, ("sorted_token_ids ", "expert_ids ", "num_tokens_post_padded "))), []

    return run_checked(c, attempt, hipkern.moe_sorting, (ids, c["experts"], c["block_m"]),
                       dict(expert_map=emap, validate=c["validate"]), judge)


def validate_sort(c, seed, verdict):
    ids, emap = sort_inputs(c, torch.Generator().manual_seed(seed))
    return verdicts(c, verdict, lambda out=None: (  # the values as validate=True checks them, then the arguments
        MS._check_values(ids, c["experts"], emap),
        MS._validate(ids.to("meta"), c["experts"], c["block_m"], None if emap is None else emap.to("meta"), out)))


# op -> (draw, run, validate); run and validate take fuzz.py's `attempt` and `verdict` as keywords (fuzz.py runs
# as __main__: this module cannot import it).
ROUTING = {"topk_softmax": (draw_topk, run_topk, validate_topk),
           "grouped_topk": (draw_grouped, run_grouped, validate_grouped),
           "moe_sorting": (draw_sort, run_sort, validate_sort)}
