"""The fused Mamba2 decode kernel (conv update + state update in one launch) against its
twin, which is the unfused conv update twin followed by the state update twin.

In the interpreter the programs run one after another, so the B/C conv state shared by a
group's programs is written early or never if the arrival counting is wrong: shapes with
several heads per group and several head-dim blocks per head make that show in y and in
both states (see the ordering note in ssmserve/kernels/mamba2_decode.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import assert_close, randn, run_benchmark_tiny, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import mamba2_decode
from ssmserve.kernels.causal_conv1d import causal_conv1d_update_ref
from ssmserve.kernels.mamba2_decode import (
    decode_update_launch_config,
    mamba2_decode_update_ref,
    mamba2_decode_update_triton,
)
from ssmserve.kernels.state_update import selective_state_update_ref

pytestmark = requires_triton

NUM_ROWS = 7


def make(Bt, H, P, G, N, K, dtype, state_dtype, seed=0, with_extras=True, with_z=False):
    """Pools (conv, ssm) of NUM_ROWS rows and the Mamba2 layout's per-step arguments."""
    gen = seeded(seed)
    conv_dim = H * P + 2 * G * N
    conv_pool = randn(NUM_ROWS, conv_dim, K - 1, gen=gen, dtype=dtype).to(DEVICE)
    ssm_pool = randn(NUM_ROWS, H, P, N, gen=gen, dtype=state_dtype, scale=0.5).to(DEVICE)
    weights = dict(
        conv_weight=randn(conv_dim, K, gen=gen, dtype=dtype, scale=0.5).to(DEVICE),
        conv_bias=randn(conv_dim, gen=gen, dtype=dtype).to(DEVICE) if with_extras else None,
        A=(-torch.exp(randn(H, gen=gen))).to(DEVICE),
        D=randn(H, gen=gen).to(DEVICE) if with_extras else None,
        dt_bias=randn(H, gen=gen).to(DEVICE) if with_extras else None,
    )

    def step(step_seed):
        g = seeded(1000 + step_seed)
        return dict(
            xbc=randn(Bt, conv_dim, gen=g, dtype=dtype).to(DEVICE),
            dt=randn(Bt, H, gen=g, dtype=dtype).to(DEVICE),
            z=randn(Bt, H, P, gen=g, dtype=dtype).to(DEVICE) if with_z else None,
        )

    return conv_pool, ssm_pool, weights, step


def run_both(conv_pool, ssm_pool, weights, inputs, slots, n_groups, steps=1, config=None, **kw):
    """`steps` decode steps through the kernel and the twin from the same pools; returns
    (y, y_ref) of the last step and the four pools."""
    conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
    slots = torch.tensor(slots, device=DEVICE)
    common = dict(n_groups=n_groups, state_slots=slots, **kw)
    for i in range(steps):
        step = inputs(i)
        args = dict(
            xbc=step["xbc"],
            conv_weight=weights["conv_weight"],
            conv_bias=weights["conv_bias"],
            dt=step["dt"],
            A=weights["A"],
            D=weights["D"],
            z=step["z"],
            dt_bias=weights["dt_bias"],
        )
        y_ref = mamba2_decode_update_ref(conv_state=conv_ref, ssm_state=ssm_ref, **args, **common)
        y = mamba2_decode_update_triton(
            conv_state=conv_pool, ssm_state=ssm_pool, **args, **common, config=config
        )
    return y, y_ref, conv_pool, conv_ref, ssm_pool, ssm_ref


def assert_counters_zero():
    for buffers in mamba2_decode._ARRIVAL_COUNTERS.values():
        for buf in buffers:
            assert int(buf.abs().sum()) == 0, "arrival counters left non-zero"


@pytest.mark.parametrize(
    "H,P,G,N,K,config",
    [
        # 6 heads share one group: 3 P blocks x 3 runs of 2 heads, 9 programs per group
        (6, 12, 1, 10, 4, {"block_p": 4, "heads_per_program": 2}),
        (8, 5, 2, 6, 3, {"block_p": 2}),  # 4 heads x 3 P blocks per group, odd dims
        # 3 groups (as under TP), each one program per P block walking its 3 heads
        (9, 6, 3, 5, 4, {"block_p": 4, "heads_per_program": 3}),
        (4, 7, 2, 8, 2, None),  # the default launch, conv width 2
        (3, 6, 3, 5, 4, {"block_p": 2}),  # a group per head (TP replicating groups)
    ],
)
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_fused_update_matches_conv_then_state_update(H, P, G, N, K, config, dtype, state_dtype):
    """Slots in permuted order with padding rows; rows not addressed stay as they were."""
    conv_pool, ssm_pool, weights, inputs = make(5, H, P, G, N, K, dtype, state_dtype)
    conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()
    slots = [5, -1, 0, 3, -1]
    y, y_ref, conv, conv_ref, ssm, ssm_ref = run_both(
        conv_pool, ssm_pool, weights, inputs, slots, G, config=config, dt_limit=(0.01, 2.0)
    )
    assert_close(y, y_ref, msg="y")
    assert_close(conv, conv_ref, msg="conv state")
    # The conv outputs are rounded to the input dtype before the state update reads them
    # (in the interpreter not always to nearest), so the input dtype bounds the state's
    # agreement too.
    assert_close(ssm, ssm_ref, dtype=dtype, msg="ssm state")
    assert torch.equal(y[[1, 4]], torch.zeros_like(y[[1, 4]]))
    untouched = [1, 2, 4, 6]
    assert torch.equal(conv[untouched], conv_before[untouched])
    assert torch.equal(ssm[untouched], ssm_before[untouched])
    assert_counters_zero()


@pytest.mark.parametrize(
    "G,config",
    [
        (1, {"block_p": 2, "heads_per_program": 3}),
        (2, {"block_p": 4}),
        (3, {"block_p": 2, "heads_per_program": 2}),
    ],
)
def test_three_consecutive_steps_keep_both_states_equal(G, config):
    """The conv window moves one token per step: a B/C window written too early or not at
    all, or a counter not reset, shows up by the later steps."""
    H, P, N, K = 6, 6, 5, 4
    conv_pool, ssm_pool, weights, inputs = make(4, H, P, G, N, K, torch.float32, torch.float32)
    y, y_ref, conv, conv_ref, ssm, ssm_ref = run_both(
        conv_pool, ssm_pool, weights, inputs, [6, 2, -1, 1], G, steps=3, config=config
    )
    assert_close(y, y_ref, msg="y after 3 steps")
    assert_close(conv, conv_ref, msg="conv state after 3 steps")
    assert_close(ssm, ssm_ref, msg="ssm state after 3 steps")
    assert_counters_zero()


def test_fused_equals_the_two_unfused_twins_and_keeps_x_b_c_apart():
    """The twin is the conv update twin then the state update twin; the kernel matches it
    with x, B and C each carrying a distinct signal (a mixed-up channel range would show)."""
    H, P, G, N, K = 4, 3, 2, 4, 4
    conv_pool, ssm_pool, weights, inputs = make(3, H, P, G, N, K, torch.float32, torch.float32)
    step = inputs(0)
    slots = torch.tensor([2, 0, 4], device=DEVICE)
    conv_a, ssm_a = conv_pool.clone(), ssm_pool.clone()
    u = causal_conv1d_update_ref(
        step["xbc"], conv_a, weights["conv_weight"], weights["conv_bias"], state_slots=slots
    )
    x, B, C = u.split([H * P, G * N, G * N], dim=-1)
    y_unfused = selective_state_update_ref(
        ssm_a,
        x.reshape(3, H, P),
        step["dt"][:, :, None].expand(3, H, P),
        weights["A"][:, None, None].expand(H, P, N),
        B.reshape(3, G, N),
        C.reshape(3, G, N),
        weights["D"][:, None].expand(H, P),
        dt_bias=weights["dt_bias"][:, None].expand(H, P),
        state_slots=slots,
    )
    conv_b, ssm_b = conv_pool.clone(), ssm_pool.clone()
    y_twin = mamba2_decode_update_ref(
        step["xbc"], conv_b, weights["conv_weight"], weights["conv_bias"], ssm_b, step["dt"],
        weights["A"], weights["D"], dt_bias=weights["dt_bias"], n_groups=G, state_slots=slots,
    )  # fmt: skip
    assert torch.equal(y_twin, y_unfused)
    assert torch.equal(conv_b, conv_a) and torch.equal(ssm_b, ssm_a)
    y = mamba2_decode_update_triton(
        step["xbc"], conv_pool, weights["conv_weight"], weights["conv_bias"], ssm_pool,
        step["dt"], weights["A"], weights["D"], dt_bias=weights["dt_bias"], n_groups=G,
        state_slots=slots, config={"block_p": 1},
    )  # fmt: skip
    assert_close(y, y_twin)
    assert_close(conv_pool, conv_b)
    assert_close(ssm_pool, ssm_b)


def test_z_gating_no_bias_no_d_no_activation():
    conv_pool, ssm_pool, weights, inputs = make(
        3, 4, 5, 2, 6, 4, torch.float32, torch.float32, with_extras=False, with_z=True
    )
    y, y_ref, conv, conv_ref, ssm, ssm_ref = run_both(
        conv_pool, ssm_pool, weights, inputs, [1, 3, 0], 2, config={"block_p": 2},
        activation=None, dt_softplus=False,
    )  # fmt: skip
    assert_close(y, y_ref)
    assert_close(conv, conv_ref)
    assert_close(ssm, ssm_ref)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_draws_the_twins_bits(state_dtype):
    """A 16-bit pool rounded stochastically: all but a few elements store the twin's bits
    (a decision flips only where its noise falls in the last float32 bit, where kernel and
    twin may differ), none more than one step apart, and the rounding did something."""
    H, P, G, N, K = 4, 8, 2, 16, 4
    conv_pool, ssm_pool, weights, inputs = make(4, H, P, G, N, K, torch.float32, state_dtype)
    kw = dict(
        rounding_offsets=torch.tensor([900, 7, 2**33 + 3, 5000], device=DEVICE), rounding_seed=9
    )
    start = ssm_pool.clone()
    y, y_ref, _, _, ssm, ssm_ref = run_both(
        conv_pool, ssm_pool, weights, inputs, [1, 3, 5, 0], G, config={"block_p": 4}, **kw
    )
    torch.testing.assert_close(y, y_ref, atol=2e-4, rtol=2e-4)
    same = (ssm.view(torch.int16) == ssm_ref.view(torch.int16)).double().mean().item()
    assert same > 0.99
    steps = (ssm.view(torch.int16).int() - ssm_ref.view(torch.int16).int()).abs()
    assert steps.max() <= 1
    nearest = start.clone()
    conv_again = make(4, H, P, G, N, K, torch.float32, state_dtype)[0]
    step = inputs(0)
    mamba2_decode_update_ref(
        step["xbc"], conv_again, weights["conv_weight"], weights["conv_bias"], nearest,
        step["dt"], weights["A"], weights["D"], dt_bias=weights["dt_bias"], n_groups=G,
        state_slots=torch.tensor([1, 3, 5, 0], device=DEVICE),
    )  # fmt: skip
    assert not torch.equal(nearest, ssm_ref)


def test_bad_arguments_are_errors():
    conv_pool, ssm_pool, weights, inputs = make(2, 4, 3, 2, 4, 4, torch.float32, torch.float32)
    step = inputs(0)
    slots = torch.tensor([0, 1], device=DEVICE)
    args = (step["xbc"], conv_pool, weights["conv_weight"], None, ssm_pool, step["dt"])
    with pytest.raises(ValueError, match="multiple of n_groups"):
        mamba2_decode_update_triton(*args, weights["A"], n_groups=3, state_slots=slots)
    with pytest.raises(ValueError, match="channels"):
        mamba2_decode_update_triton(*args, weights["A"], n_groups=1, state_slots=slots)
    with pytest.raises(ValueError, match="activation"):
        mamba2_decode_update_ref(
            *args, weights["A"], n_groups=2, state_slots=slots, activation="gelu"
        )
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="unknown launch parameter"):
        decode_update_launch_config(3, 4, 2, 2, cpu, {"block_n": 4})
    with pytest.raises(ValueError, match="power of two"):
        decode_update_launch_config(3, 4, 2, 2, cpu, {"block_p": 3})
    with pytest.raises(ValueError, match="must divide"):
        decode_update_launch_config(3, 4, 2, 2, cpu, {"heads_per_program": 3})
    default = decode_update_launch_config(64, 128, 128, 1, cpu)
    assert default == {"block_p": 32, "heads_per_program": 1, "num_warps": 4}
    assert math.isfinite(float(mamba2_decode_update_triton(
        *args, weights["A"], n_groups=2, state_slots=slots).abs().sum()))  # fmt: skip


def test_benchmark_tiny_smoke_run(tmp_path):
    """benchmarks/kernels/bench_mamba2_decode.py --tiny runs, its checks pass, and it times
    both the fused kernel and the two launches it replaces."""
    results = run_benchmark_tiny("bench_mamba2_decode.py", "accuracy,sizes", tmp_path)
    assert not results["errors"]
    assert results["checks"] and all(c["ok"] for c in results["checks"])
    paths = {t["config"] for t in results["timings"]}
    assert paths == {"fused", "conv update + state update"}
