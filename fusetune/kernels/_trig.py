"""sin and cos for kernel epilogues that rotate whole output tiles (qkv's RoPE).

libdevice's sinf/cosf are exact to the last bit but carry a slow path for huge arguments
(Payne-Hanek reduction through a local-memory table): on a [128, 64] float32 tile next to two
accumulators that path alone pushed qkv's epilogue into register spills. Angles here are
position × frequency, below ~1e5 radians: a two-constant (Cody-Waite) reduction to
[-π, π] and two short polynomials are accurate to ~1e-6 absolute, branch-free and cheap in
registers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sincos(angle):
    """(sin(angle), cos(angle)) of a float32 tensor, absolute error below ~1e-6 for
    |angle| < 1e5 (checked against float64 in tests/kernels/test_qkv.py)."""
    # angle = k·2π + r, r in [-π, π]. 2π = 6.28125 + 0.0019353071795864769: the first part
    # has 8 significant bits, so k·6.28125 is exact in float32 for k < 2^16.
    k = tl.floor(angle * 0.15915494309189535 + 0.5)
    r = angle - k * 6.28125
    r = r - k * 0.0019353071795864769
    # Taylor series of sin and cos at h = r/2 in [-π/2, π/2] (truncation error < 6e-8),
    # then the double-angle formulas.
    h = 0.5 * r
    h2 = h * h
    s = h * (1.0 + h2 * (-1.6666666666666666e-1 + h2 * (8.333333333333333e-3 + h2 * (
        -1.984126984126984e-4 + h2 * (2.755731922398589e-6 + h2 * -2.505210838544172e-8)))))
    c = 1.0 + h2 * (-0.5 + h2 * (4.1666666666666664e-2 + h2 * (-1.388888888888889e-3 + h2 * (
        2.48015873015873e-5 + h2 * (-2.755731922398589e-7 + h2 * 2.08767569878681e-9)))))
    return 2.0 * s * c, 1.0 - 2.0 * s * s
