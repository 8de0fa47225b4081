"""Benchmarks: ``python -m hipkern.bench [all|topk_softmax ...] [--out DIR] [--quick]``.

Each benchmark checks the op against its reference with checkAllclose on every shape before timing
it, prints the reference logs' table format plus bandwidth, and writes CSV under --out.
"""
COPY_BW_TBPS = 3.0  # measured H100 device-to-device copy bandwidth (read + write), DESIGN.md
