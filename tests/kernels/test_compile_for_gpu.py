"""Every Triton kernel variant the models launch compiles for an H100/H200 (sm_90).

The interpreter runs a kernel's Python without compiling it, so a kernel that the GPU
compiler refuses (a type mismatch, an op or a layout the backend lacks) would first fail
on a GPU. Here the launches of a few tiny models (every Triton op and launch path they
take: prefill and decode, the fused one-row decode, prefix-cache snapshots, MoE routing
with the per-assignment and the sorted paths, the selective scan) are recorded in the
interpreter, one per compile key, and each is compiled for sm_90 through Triton's own
steps (its CUDA backend and the ptxas it ships; no GPU needed). It proves that they
compile, not that they compute the right thing: the GPU tests do that.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_testing import DEVICE, requires_triton

from ssmserve import LLM, SamplingParams
from ssmserve.kernels._common import LazyKernel
from ssmserve.kernels.decode_inputs import STATIC, decode_inputs_triton
from ssmserve.kernels.gemv import gemv_act_and_mul_triton, gemv_triton
from ssmserve.kernels.paged_attention import write_kv_cache_triton
from ssmserve.kernels.rotary import rotary_decode_attention_triton
from ssmserve.layers.batch import HEADER_LEN, ForwardBatch, StepInputs
from tests.tiny_models import make_tiny_checkpoint

pytestmark = [
    requires_triton,
    pytest.mark.skipif(
        importlib.util.find_spec("triton.backends.nvidia") is None,
        reason="Triton's CUDA backend is not installed",
    ),
]


def stand_in(value):
    """What Triton specialises a launch argument on: a tensor's dtype and whether its
    address is 16-byte aligned (a small tensor with the same), anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    aligned = value.data_ptr() % 16 == 0
    return torch.empty(32, dtype=value.dtype)[0 if aligned else 1 :]


def test_every_kernel_variant_the_models_launch_compiles_for_sm90(tmp_path, monkeypatch):
    launches: dict[tuple[str, str], tuple[LazyKernel, tuple, dict]] = {}
    getitem = LazyKernel.__getitem__

    def recording(kernel: LazyKernel, grid):
        launch = getitem(kernel, grid)

        def recorded(*args, **kwargs):
            key = (kernel.name, kernel.compile_key(*args, **kwargs))
            launches.setdefault(key, (kernel, args, kwargs))
            return launch(*args, **kwargs)

        return recorded

    monkeypatch.setattr(LazyKernel, "__getitem__", recording)
    common = dict(
        device=DEVICE.type, dtype="float32", enforce_eager=True, cache_memory=2**27,
        kernel_backend="triton", prefix_checkpoint_interval=16,
    )  # fmt: skip
    # Prompts of one token to past a checkpoint interval, six of them: decode steps of
    # one row (the fused decode, MoE per assignment) and of several (MoE sorted).
    lengths = (1, 21, 5, 3, 4, 2)
    prompts = [{"prompt_token_ids": [5 + (3 * i + n) % 90 for i in range(n)]} for n in lengths]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    # Granite 4.0-H covers Mamba2, attention, MoE and the gated MLP; FalconMamba the Mamba1
    # kernels. A layer of each kind launches every variant that more layers would (the
    # interpreter runs each launch in full, so more layers cost time and add nothing).
    shapes = {
        "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["mamba", "attention"]),
        "falcon_mamba": dict(num_hidden_layers=2),  # a norm between layers, and the last
    }
    for family, shape in shapes.items():
        path = make_tiny_checkpoint(str(tmp_path / family), family, seed=0, **shape)
        llm = LLM(path, **common)
        # The one-row linears through the GEMV, as decode with PDL runs them (a gated
        # MLP's gate_up with its act(gate) * up).
        for module in llm.llm_engine.executor.runner.model.modules():
            if hasattr(module, "decode_gemv"):
                module.decode_gemv = gemv_triton
            if hasattr(module, "decode_gemv_act_and_mul"):
                module.decode_gemv_act_and_mul = gemv_act_and_mul_triton
        llm.generate(prompts[:1], params, use_tqdm=False)  # one row alone
        llm.generate(prompts, params, use_tqdm=False)
        del llm
    # Attention without RoPE writes its K/V on their own (RoPE's kernel writes them for
    # the models above): a write of one token's.
    kv = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 16, device=DEVICE)
    write_kv_cache_triton(kv, kv, cache, cache.clone(), torch.tensor([3], device=DEVICE))
    # A decode graph's inputs written from a packed step (CUDA graphs run only on a GPU).
    step = StepInputs(logits_indices=[0], num_decodes=1, fills=[(0, 0)])
    step.add_sequence([5], 3, [2], 4, 0)
    packed = step.pack()
    static = ForwardBatch.from_packed(packed.clone(), DEVICE)
    decode_inputs_triton(
        packed.to(DEVICE), packed[:HEADER_LEN].tolist(),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
        {name: getattr(static, name) for name in STATIC}, 1,
    )  # fmt: skip
    # A decode step's attention with RoPE and the K/V write in its launch, as graphs with
    # PDL run it at batch 1 (its first key tile read before the wait).
    qkv = torch.zeros(1, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    kv_cache = torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    rotary_decode_attention_triton(
        qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], kv_cache, kv_cache.clone(),
        positions=one.long(), inv_freq=torch.ones(8, device=DEVICE),
        slot_mapping=one.long(), block_tables=one.view(1, 1),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=one + 1, scale=0.25, decode_config={"prefetch": True},
    )  # fmt: skip
    # A bf16 model's LM head at one row: the GEMV stores float32 logits.
    head = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEVICE)
    gemv_triton(head[:1], head, out_dtype=torch.float32)
    monkeypatch.undo()
    names = {name for name, _ in launches}
    gemv_acts = {kw["ACT"] for k, _, kw in launches.values() if k.name == "_gemv_kernel"}
    assert -1 in gemv_acts and any(act >= 0 for act in gemv_acts), gemv_acts
    assert any(
        k.name == "_gemv_kernel" and a[0].dtype == torch.bfloat16 and a[3].dtype == torch.float32
        for k, a, _ in launches.values()
    )
    # RoPE writes the K/V into the cache in its launch.
    rope = {kw["WRITE_KV"] for k, _, kw in launches.values() if k.name == "_rotary_kernel"}
    assert rope == {True}, rope
    # Decode steps with PDL rotate and write them inside the decode attention's launch.
    attention = {
        kw["ROPE"] for k, _, kw in launches.values() if k.name == "_paged_attention_kernel"
    }
    assert attention == {True, False}, attention
    for expected in (
        "_mamba2_decode_kernel",
        "_ssd_chunk_scan_kernel",
        "_selective_scan_kernel",
        "_paged_attention_kernel",
        "_moe_route_kernel",
        "_moe_up_kernel",
        "_align_kernel",
        "_gemv_kernel",
        "_decode_inputs_kernel",
        "_draw_chunks_kernel",  # the sampler's draw (greedy here)
        "_draw_merge_kernel",
    ):
        assert expected in names, (expected, sorted(names))
    # The kernels that take PDL compile launched with it too (sm_90 GPUs run them so with
    # --decode-pdl; the interpreter cannot).
    pdl_variants = [
        (kernel, args, {**kwargs, "PDL": True, "launch_pdl": True})
        for kernel, args, kwargs in launches.values()
        if kwargs.get("PDL") is False
    ]
    # And the decode attention that reads its first key tile before the wait, or masks
    # every tile in one loop.
    pdl_variants += [
        (kernel, args, {**kwargs, **option})
        for kernel, args, kwargs in pdl_variants
        if kernel.name == "_paged_attention_kernel" and not kwargs["SEARCH_SEQS"]
        for option in ({"PREFETCH": True}, {"MASK_SKIP": False})
    ]
    # And the sampler's draw of sampled rows (temperature and noise).
    pdl_variants += [
        (kernel, args, {**kwargs, "SAMPLED": True})
        for kernel, args, kwargs in launches.values()
        if kernel.name == "_draw_chunks_kernel"
    ]
    pdl_names = {kernel.name for kernel, _, _ in pdl_variants}
    assert {
        "_gemv_kernel",
        "_mamba2_decode_kernel",
        "_add_rms_norm_kernel",
        "_paged_attention_kernel",
        "_write_kv_kernel",
        "_rotary_kernel",
        "_state_update_kernel",
        "_conv1d_update_kernel",
    } <= pdl_names, sorted(pdl_names)
    specs = [
        (kernel.fn.__module__, kernel.fn.__name__, [stand_in(a) for a in args],
         {k: stand_in(v) for k, v in kwargs.items()})
        for kernel, args, kwargs in [*launches.values(), *pdl_variants]
    ]  # fmt: skip
    torch.save(specs, tmp_path / "launches.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child imports ssmserve from this checkout, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("gpu_compile.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "launches.pt")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
