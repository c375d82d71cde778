"""Stochastic rounding of float32 values to bfloat16 or float16, with counter-based noise.

A value between two neighbours of the 16-bit grid rounds up with probability equal to its
distance from the lower one (in units of the grid spacing), so E[round(x)] = x: errors
average out over the many writes a recurrent state takes instead of drifting one way, as
round-to-nearest's can. The rounding adds uniform random bits below the kept mantissa to
the float32 bit pattern and truncates:

- bfloat16 keeps float32's exponent range: add a random 16-bit integer to the pattern,
  clear the low 16 bits. The carry crosses binades and subnormals correctly, since the
  pattern is monotone in the value and evenly spaced within each binade.
- float16 keeps 10 mantissa bits: add a random 13-bit integer, clear the low 13 bits.
  Below 2^-14 (float16's subnormals, spacing 2^-24) the magnitude is first moved to
  [2^-14, 2^-13) by adding 2^-14, where float32's 13 lowest bits are the ones float16
  drops, and moved back after (the add rounds to float32's spacing there, 2^-37, far
  below float16's 2^-24; the subtraction is exact).

Finite values never become infinite: a magnitude past the largest finite 16-bit value
saturates to it (round-to-nearest would give infinity). Infinities and NaNs stay as
they are.

The noise is a hash, not an RNG state: the bits of element `e` of a row with counter
`offset` (the token's position) under key `seed` (per layer) are

    row_key = hash32(hash32(offset mod 2^32) ^ launch_seed(seed))
    bits    = hash32(row_key ^ e)

with `hash32` an xor-shift-multiply mixer (bijective on 32-bit integers). So the rounding
is deterministic given the seed and the positions, needs no tensors of RNG state, and a
request's noise does not depend on which batch row or state slot it has.

`*_ref` functions are the PyTorch definitions (int64 arithmetic, masked to 32 bits); the
Triton device functions compute the same bits.
"""

from __future__ import annotations

import torch

from ssmserve.kernels._common import device_function, tl

MASK32 = 0xFFFFFFFF
_MUL_1, _MUL_2 = 0x7FEB352D, 0x846CA68B
ROUNDED_DTYPES = (torch.bfloat16, torch.float16)
# float16: 2^-14 (smallest normal) and the largest finite value.
FP16_MIN_NORMAL = 6.103515625e-05
FP16_MAX = 65504.0
FP32_MAX = 3.4028234663852886e38


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for 0 <= x, c < 2^32 without overflowing int64: c in 16-bit halves."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def hash32_ref(x: torch.Tensor | int) -> torch.Tensor | int:
    """The 32-bit mixer on int64 tensors (or Python ints) holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_2)
    return x ^ (x >> 16)


def rounding_key(seed: int, layer: int, rank: int = 0) -> int:
    """The 32-bit rounding seed of one layer position on one tensor-parallel rank: distinct
    layers and ranks get unrelated noise for the same positions and element indices."""
    key = hash32_ref(seed & MASK32)
    key = hash32_ref(key ^ (layer & MASK32))
    return hash32_ref(key ^ (rank & MASK32))


def launch_seed(seed: int) -> int:
    """`seed` as the kernel receives it: 32 bits, with bit 31 set so that Triton always
    passes it as a runtime int64 (NOTE: small values such as 1 would otherwise be
    specialised into the compiled kernel). Only the low 32 bits are used."""
    return (seed & 0x7FFFFFFF) | 0x80000000


def rounding_bits_ref(seed: int, offsets: torch.Tensor, numel: int) -> torch.Tensor:
    """Random bits [len(offsets), numel] (int64 holding uint32): row r, element e."""
    seed = launch_seed(seed) & MASK32
    row_key = hash32_ref(hash32_ref(offsets.long() & MASK32) ^ seed)  # [R]
    elements = torch.arange(numel, dtype=torch.long, device=offsets.device)
    return hash32_ref(row_key[:, None] ^ elements[None, :])


def _bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).long() & MASK32


def _float_of(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


def stochastic_round_ref(
    values: torch.Tensor, dtype: torch.dtype, random_bits: torch.Tensor
) -> torch.Tensor:
    """float32 `values` rounded stochastically to `dtype` (bfloat16 or float16), with
    `random_bits` (int64 holding uint32, the shape of `values`) as the noise."""
    values = values.float()
    if dtype == torch.bfloat16:
        bits = _bits_of(values)
        magnitude = bits & 0x7FFFFFFF
        rounded = (bits + (random_bits & 0xFFFF)) & 0xFFFF0000
        overflow = ((rounded & 0x7FFFFFFF) == 0x7F800000) & (magnitude < 0x7F800000)
        rounded = torch.where(overflow, (bits & 0x80000000) | 0x7F7F0000, rounded)
        rounded = torch.where(magnitude > 0x7F800000, bits, rounded)
        return _float_of(rounded).to(dtype)
    if dtype == torch.float16:
        magnitude = values.abs()
        subnormal = magnitude < FP16_MIN_NORMAL
        shifted = torch.where(subnormal, magnitude + FP16_MIN_NORMAL, magnitude)
        rounded = _float_of((_bits_of(shifted) + (random_bits & 0x1FFF)) & 0xFFFFE000)
        rounded = torch.where(subnormal, rounded - FP16_MIN_NORMAL, rounded)
        rounded = rounded.clamp(max=FP16_MAX)
        signed = _float_of(_bits_of(rounded) | (_bits_of(values) & 0x80000000))
        return torch.where(magnitude <= FP32_MAX, signed, values).to(dtype)
    raise ValueError(f"stochastic rounding goes to bfloat16 or float16, not {dtype}")


# ---------------------------------------------------------------------------- Triton


@device_function
def hash32(x):
    # uint32 in, uint32 out: the same mixer as hash32_ref (multiplies wrap mod 2^32).
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@device_function
def round_to_bfloat16_stochastic(value, random):
    # float32 value, uint32 random -> float32 holding a bfloat16 value (low 16 bits zero).
    bits = value.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    rounded = (bits + (random & 0xFFFF)) & 0xFFFF0000
    overflow = ((rounded & 0x7FFFFFFF) == 0x7F800000) & (magnitude < 0x7F800000)
    rounded = tl.where(overflow, (bits & 0x80000000) | 0x7F7F0000, rounded)
    rounded = tl.where(magnitude > 0x7F800000, bits, rounded)
    return rounded.to(tl.float32, bitcast=True)


@device_function
def round_to_float16_stochastic(value, random):
    # float32 value, uint32 random -> float32 holding a float16 value.
    magnitude = tl.abs(value)
    subnormal = magnitude < 6.103515625e-05
    shifted = tl.where(subnormal, magnitude + 6.103515625e-05, magnitude)
    bits = (shifted.to(tl.uint32, bitcast=True) + (random & 0x1FFF)) & 0xFFFFE000
    rounded = bits.to(tl.float32, bitcast=True)
    rounded = tl.where(subnormal, rounded - 6.103515625e-05, rounded)
    rounded = tl.minimum(rounded, 65504.0)
    sign = value.to(tl.uint32, bitcast=True) & 0x80000000
    signed = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(magnitude <= 3.4028234663852886e38, signed, value)


@device_function
def store_state(
    pool_ptr,
    ptrs,
    state,
    mask,
    offsets_ptr,
    row,
    seed,
    head,
    P,
    N,
    offs_p,
    offs_n,
    ROUNDING: tl.constexpr,
):
    # Store a float32 [P, N] state tile of `head` into its pool (`pool_ptr`'s dtype):
    # rounded to nearest (ROUNDING 0), or stochastically to bfloat16 (1) / float16 (2)
    # with noise keyed by the row's position offset, the launch seed and each element's
    # index in the head's state (what the state-update twin's noise is keyed by).
    if ROUNDING == 0:
        tl.store(ptrs, state.to(pool_ptr.dtype.element_ty), mask=mask)
    else:
        offset = tl.load(offsets_ptr + row).to(tl.uint32)
        row_key = hash32(hash32(offset) ^ seed.to(tl.uint32))
        element = (head * P + offs_p[:, None]) * N + offs_n[None, :]
        random = hash32(row_key ^ element.to(tl.uint32))
        if ROUNDING == 1:
            stored = round_to_bfloat16_stochastic(state, random)
        else:
            stored = round_to_float16_stochastic(state, random)
        # Exact: `stored` holds a value of the pool's dtype.
        tl.store(ptrs, stored.to(pool_ptr.dtype.element_ty), mask=mask)
