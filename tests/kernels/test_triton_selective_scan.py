"""Triton Mamba1 selective scan against its PyTorch twin (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.selective_scan import (
    selective_scan_varlen_ref,
    selective_scan_varlen_triton,
)

pytestmark = requires_triton


def make_inputs(lengths, Dm, N, dtype, seed=0, with_dz=True):
    gen = seeded(seed)
    T = sum(lengths)
    inp = dict(
        u=randn(T, Dm, gen=gen, dtype=dtype),
        delta=randn(T, Dm, gen=gen, dtype=dtype, scale=0.5),
        A=-torch.exp(randn(Dm, N, gen=gen, scale=0.5)),
        B=randn(T, N, gen=gen, dtype=dtype),
        C=randn(T, N, gen=gen, dtype=dtype),
        D=randn(Dm, gen=gen) if with_dz else None,
        z=randn(T, Dm, gen=gen, dtype=dtype) if with_dz else None,
        delta_bias=randn(Dm, gen=gen, scale=0.5) if with_dz else None,
        ssm_state=randn(4, Dm, N, gen=gen),
    )
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in inp.items()}


def run(fn, inp, lengths, slots, init):
    return fn(
        inp["u"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"],
        cu_seqlens=cu_seqlens_of(lengths).to(DEVICE), ssm_state=inp["ssm_state"],
        state_slots=torch.tensor(slots, device=DEVICE),
        has_initial_state=torch.tensor(init, device=DEVICE), z=inp["z"],
        delta_bias=inp["delta_bias"],
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("with_dz", [False, True])
def test_matches_twin(dtype, varlen, with_dz):
    lengths = [6, 0, 1, 9] if varlen else [13]
    slots = [3, 0, 2, 1] if varlen else [2]
    init = [True, False, False, True] if varlen else [True]
    inp = make_inputs(lengths, 7, 5, dtype, with_dz=with_dz)
    pool = inp["ssm_state"].clone()
    y_ref = run(selective_scan_varlen_ref, inp, lengths, slots, init)
    pool_ref, inp["ssm_state"] = inp["ssm_state"], pool
    y = run(selective_scan_varlen_triton, inp, lengths, slots, init)
    assert_close(y, y_ref)
    assert_close(pool, pool_ref)
