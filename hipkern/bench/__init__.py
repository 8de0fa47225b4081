"""Benchmarks: ``python -m hipkern.bench [all|topk_softmax ...] [--out DIR] [--quick]``.

Each benchmark checks the op against its reference with checkAllclose on every shape before timing
it, prints the reference logs' table format plus bandwidth, and writes CSV under --out.
"""
COPY_BW_TBPS = 3.0  # the H100's measured device-to-device copy bandwidth (read + write) the issues' bars use


def device_line() -> str:
    """The GPU this run is on: its name, its UUID, its own copy rate (a 1 GiB ``copy_``, events) and
    the events' floor of a call in run_perftest (a one-element ``add_``, whose kernel takes ~1 us: the
    rest, ~3 us on the H100, every call pays; paged_attention NOTES.md, 2026-11-27 (6)).

    Units of one model differ: two H100s ran fused_moe's same code ~5 % apart (fused_moe NOTES.md,
    2026-11-25), so runs from different units compare only through this line.
    """
    import torch

    from hipkern.testing import run_perftest

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    _, us = run_perftest(dst.copy_, src, num_iters=20)
    del src, dst
    torch.cuda.empty_cache()  # the benchmarks' largest shapes need the 2-3 GiB back
    tbps = 2 * (1 << 30) / us / 1e6
    one = torch.zeros(1, device="cuda")
    _, floor_us = run_perftest(one.add_, 1.0, num_iters=200)
    return (f"# device {dev}: {props.name}, uuid {getattr(props, 'uuid', 'unknown')}; copy_ of 1 GiB here "
            f"{tbps:.3f} TB/s read + write (the bars' reference: {COPY_BW_TBPS:.1f} TB/s); "
            f"a one-element call here {floor_us:.2f} us")


def traced_module(family: str, define: str, reader: str, **params):
    """The bf16 module of `family` with `params`, built with the diagnostic preprocessor `define` under
    a cache name of its own, and its trace reader `reader` (int reader(void* host, int blocks)) exported:
    moe_trace's and pa_trace's timelines."""
    import dataclasses

    import torch

    from hipkern import jit
    from hipkern.jit import modules

    spec = modules.spec(family, dtype="bfloat16", **params)
    spec = dataclasses.replace(spec, name=spec.name + "_trace", defines=spec.defines + ((define, 1),),
                               functions=spec.functions + ((reader, "i32", ("ptr", "i32")),))
    return jit.load(spec, jit.platform.load_arch(torch.cuda.current_device()))
