"""`ssmserve bench latency | throughput`: timing, floors, the peer file, the JSON; and the
progress bar of LLM.generate."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from ssmserve import LLM, SamplingParams
from ssmserve.bench.common import percentile
from ssmserve.bench.floors import DevicePeaks, ModelCosts, device_peaks, engine_costs
from ssmserve.bench.latency import load_llama_bench, run_latency
from ssmserve.bench.throughput import run_throughput, throughput_floor_s
from ssmserve.cli import main
from ssmserve.config import EngineConfig
from ssmserve.engine.engine import LLMEngine
from ssmserve.outputs import CompletionOutput, RequestOutput

CPU = dict(device="cpu", dtype="float32")
ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """The module of the script benchmarks/<name>.py (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bamba_engine(checkpoint):
    return LLMEngine(EngineConfig(model=checkpoint("bamba"), max_num_seqs=3, **CPU))


class TimedFakeEngine:
    """An engine whose steps take known times: a prefill step `prefill_s`, a decode step
    `decode_s`; each prompt needs `prefill_steps` steps before its first token."""

    def __init__(self, prefill_s: float, decode_s: float, prefill_steps: int) -> None:
        self.prefill_s, self.decode_s, self.prefill_steps = prefill_s, decode_s, prefill_steps
        self.model_config = SimpleNamespace(vocab_size=50)
        self.requests: dict[str, list] = {}  # id -> [steps done, tokens, max_tokens]

    def add_request(self, request_id, prompt, params) -> None:
        self.requests[request_id] = [0, 0, params.max_tokens]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        prefilling = any(r[0] < self.prefill_steps for r in self.requests.values())
        time.sleep(self.prefill_s if prefilling else self.decode_s)
        outputs = []
        for rid, r in list(self.requests.items()):
            r[0] += 1
            if r[0] >= self.prefill_steps:
                r[1] += 1
            done = r[1] == r[2]
            outputs.append(
                RequestOutput(rid, None, [], None, [CompletionOutput(0, "", [7] * r[1])], done)
            )
            if done:
                del self.requests[rid]
        return outputs


def test_latency_times_the_prefill_apart_from_the_decode_steps():
    engine = TimedFakeEngine(prefill_s=0.06, decode_s=0.01, prefill_steps=2)
    samples = run_latency(
        engine,
        batch_size=2,
        input_len=4,
        output_len=6,
        num_iters_warmup=1,
        num_iters=2,
        progress=False,
    )
    assert len(samples) == 2
    for s in samples:
        # Two 60 ms prefill steps before the first token; then five 10 ms decode steps.
        assert 0.12 <= s.ttft < 0.12 + 0.1
        assert 0.01 <= s.decode_per_token < 0.01 + 0.02
        assert s.e2e == pytest.approx(s.ttft + 5 * s.decode_per_token)
        assert 0.01 <= s.decode_step_p50 < 0.01 + 0.02  # the five decode calls' median


def test_latency_on_a_real_engine_frees_everything(bamba_engine):
    samples = run_latency(
        bamba_engine,
        batch_size=2,
        input_len=12,
        output_len=5,
        num_iters_warmup=0,
        num_iters=2,
        progress=False,
    )
    assert len(samples) == 2 and all(0 < s.ttft < s.e2e for s in samples)
    stats = bamba_engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


def test_latency_rejects_a_short_run():
    engine = TimedFakeEngine(0, 0, 1)
    with pytest.raises(ValueError, match="num_iters must be at least 1"):
        run_latency(
            engine, batch_size=1, input_len=1, output_len=1, num_iters_warmup=0, num_iters=0
        )


def test_throughput_counts_every_token_and_runs_the_baseline_only_when_asked(bamba_engine):
    rows = run_throughput(bamba_engine, num_prompts=5, input_len=10, output_len=4, progress=False)
    assert [r["mode"] for r in rows] == ["continuous batching"]
    assert rows[0]["output_tokens"] == 5 * 4 and rows[0]["prompt_tokens"] == 5 * 10
    assert rows[0]["concurrency"] == 3  # max_num_seqs of the engine
    rows = run_throughput(
        bamba_engine,
        num_prompts=2,
        input_len=6,
        output_len=3,
        sequential_baseline=True,
        progress=False,
    )
    assert [r["mode"] for r in rows] == ["continuous batching", "one at a time"]
    assert rows[1]["output_tokens"] == 2 * 3 and rows[1]["concurrency"] == 1


def test_costs_of_the_tiny_bamba_match_its_config(bamba_engine):
    costs = engine_costs(bamba_engine)
    cfg = bamba_engine.model_config.hf_config
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf_params = sum(p.numel() for p in hf.parameters())
    embedding = cfg.vocab_size * cfg.hidden_size
    assert not cfg.tie_word_embeddings
    assert costs.body_params + 2 * embedding == hf_params
    assert costs.weight_bytes == (hf_params - embedding) * 4  # float32; the lookup table not
    attn = len(cfg.attn_layer_indices)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert costs.kv_bytes_per_token == attn * 2 * cfg.num_key_value_heads * head_dim * 4
    mamba = cfg.num_hidden_layers - attn
    d_inner = cfg.mamba_n_heads * cfg.mamba_d_head
    conv = (d_inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state) * (cfg.mamba_d_conv - 1)
    ssm = cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state
    assert costs.state_bytes_per_seq == mamba * (conv + ssm) * 4
    per_pair = 4 * cfg.num_attention_heads * head_dim * attn  # QK^T and PV, 2 FLOPs a MAC
    assert costs.attention_flops_per_pair == per_pair


def test_throughput_floor_counts_the_fewest_steps_and_all_traffic():
    costs = ModelCosts(
        body_params=10,
        head_params=3,
        weight_bytes=1000,
        state_bytes_per_seq=50,
        kv_bytes_per_token=0,
        attention_flops_per_pair=0,
    )
    shape = dict(num_prompts=5, input_len=8, output_len=4, concurrency=2)
    by_bytes = DevicePeaks("x", bandwidth=1000.0, flops=1e30, source="test")
    # 5 requests of 4 output tokens, 2 at once: 3 rounds of 3 decode steps after a first
    # step, each reading the 1000 weight bytes; each request writes its state once at
    # prefill and reads + writes it at each of its 3 decode steps.
    expected = (3 * 3 + 1) * 1000 + 5 * 50 + 5 * 3 * 2 * 50
    assert throughput_floor_s(costs, by_bytes, **shape) == pytest.approx(expected / 1000)
    by_flops = DevicePeaks("x", bandwidth=1e30, flops=1.0, source="test")
    # Per request: prefill 2 x 10 x 8 + 2 x 3 (the head for the last token only), then
    # 3 decode tokens of 2 x (10 + 3) each.
    expected = 5 * (2 * 10 * 8 + 2 * 3 + 3 * 2 * 13)
    assert throughput_floor_s(costs, by_flops, **shape) == pytest.approx(expected)


def test_device_peaks_from_the_table_or_the_flags():
    h200 = device_peaks("NVIDIA H200")
    assert h200.bandwidth == 4.25e12 and h200.flops == 783e12
    assert device_peaks("cpu (x86_64, 2 cores)") is None
    mine = device_peaks("cpu (x86_64, 2 cores)", 0.1, 2.0)
    assert mine.bandwidth == 1e11 and mine.flops == 2e12
    assert device_peaks("NVIDIA H200", 4.0).flops == 783e12
    with pytest.raises(ValueError, match="pass both --bandwidth"):
        device_peaks("cpu", 0.1)
    with pytest.raises(ValueError, match="positive"):
        device_peaks("NVIDIA H200", -1.0)


def test_h100_peaks_are_the_measured_ceilings():
    """The H100 entry is what bench_ceilings.py measured on that card (to the table's
    three figures); a PCIe H100, with far less bandwidth, gets no floors."""
    path = Path(__file__).parents[1] / "benchmarks/results/ceilings_2026-12-06_h100.json"
    measured = json.loads(path.read_text())
    peaks = device_peaks(measured["env"]["gpu"])
    assert peaks.bandwidth == pytest.approx(measured["copy_bytes_per_s"], rel=5e-3)
    assert peaks.flops == pytest.approx(measured["bf16_flop_per_s"], rel=5e-3)
    assert device_peaks("NVIDIA H100 PCIe") is None


def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)  # 1 + 0.9 x 4 ranks: 4 + 0.6
    assert percentile([7.0], 99) == 7.0


def _llama_bench_test(n_prompt, n_gen, n_depth, samples_ns):
    # The fields llama-bench's JSON printer writes that the reader uses, plus a few others.
    return {
        "build_commit": "abc1234",
        "gpu_info": "NVIDIA H200",
        "model_filename": "m.gguf",
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": n_depth,
        "avg_ns": sum(samples_ns) // len(samples_ns),
        "samples_ns": samples_ns,
        "samples_ts": [1e9 * (n_prompt + n_gen) / s for s in samples_ns],
    }


@pytest.fixture
def llama_bench_file(tmp_path):
    tests = [
        _llama_bench_test(2048, 0, 0, [108_000_000, 110_000_000, 106_000_000]),
        _llama_bench_test(0, 128, 0, [500_000_000, 510_000_000, 490_000_000]),
        _llama_bench_test(2048, 0, 2048, [150_000_000, 150_000_000, 150_000_000]),
        _llama_bench_test(0, 128, 2048, [524_800_000, 524_800_000, 524_800_000]),
    ]
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(tests, indent=2))
    return path


def test_peer_file_gives_prefill_from_empty_context_and_decode_at_the_prompt_depth(
    llama_bench_file,
):
    peer = load_llama_bench(str(llama_bench_file), 2048)
    assert peer.prefill_tokens == 2048 and peer.prefill == [0.108, 0.110, 0.106]
    assert peer.decode_depth == 2048 and peer.decode_tokens == 128
    assert peer.decode_per_token == pytest.approx([0.0041] * 3)  # 524.8 ms / 128 tokens
    assert peer.source["build_commit"] == "abc1234"
    # JSON lines (llama-bench -o jsonl) read the same.
    lines = llama_bench_file.with_suffix(".jsonl")
    lines.write_text("\n".join(json.dumps(t) for t in json.loads(llama_bench_file.read_text())))
    from_lines = load_llama_bench(str(lines), 2048)
    assert (from_lines.prefill, from_lines.decode_per_token) == (
        peer.prefill,
        peer.decode_per_token,
    )


def test_peer_file_that_is_not_llama_bench_output_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"tokens_per_s": 5}))
    with pytest.raises(ValueError, match="not llama-bench output"):
        load_llama_bench(str(path), 16)
    path.write_text("not json {")
    with pytest.raises(ValueError, match="is not JSON"):
        load_llama_bench(str(path), 16)


def test_bench_latency_command_prints_floors_and_the_peer_and_writes_json(
    checkpoint, llama_bench_file, tmp_path, capsys
):
    out_json = tmp_path / "lat.json"
    argv = (
        f"bench latency --model {checkpoint('mamba2')} --device cpu --batch-size 1 "
        "--input-len 8 --output-len 4 --num-iters-warmup 1 --num-iters 3 "
        f"--bandwidth 0.05 --peak-tflops 0.5 --peer-result {llama_bench_file} "
        f"--output-json {out_json}"
    ).split()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "latency: 100%" in captured.err  # the progress bar
    table = captured.out
    assert "0.05 TB/s, 0.5 TFLOP/s" in table
    decode_row = next(line for line in table.splitlines() if line.startswith("| decode"))
    assert re.search(r"\d+\.\d\dx", decode_row)  # the median over its floor
    assert "llama.cpp decode, per token (tg128 @ 0)" in table  # the depth nearest 8
    report = json.loads(out_json.read_text())
    keys = ("date", "device", "commit", "command", "config", "model", "params", "peaks", "cache")
    for key in keys:
        assert report[key], key
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode == 0:
        assert re.fullmatch(head.stdout.decode().strip() + "(-dirty)?", report["commit"])
    else:  # a copy of the tree without .git
        assert report["commit"].startswith("unknown (not a git checkout")
    assert report["config"]["model"] == checkpoint("mamba2")
    assert report["params"]["batch_size"] == 1
    assert len(report["results"]["samples_s"]) == 3
    summary = report["results"]["summary_s"]["decode_per_token"]
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
    floor = report["results"]["floors_s"]["decode_per_token"]
    costs = report["model"]["costs"]
    assert floor >= costs["weight_bytes"] / 0.05e12  # every weight is read each step
    assert report["results"]["peer"]["decode_depth"] == 0


def test_bench_latency_refuses_a_peer_file_at_batch_above_one(llama_bench_file, capsys):
    argv = ["bench", "latency", "--batch-size", "2", "--peer-result", str(llama_bench_file)]
    assert main(argv) == 2
    assert "use --batch-size 1" in capsys.readouterr().err


def test_bench_throughput_command_table_and_json(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SSMSERVE_COMMIT", "0123abc (the device copy)")
    out_json = tmp_path / "thr.json"
    model = checkpoint("mamba")
    argv = (
        f"bench throughput --model {model} --device cpu --num-prompts 4 --input-len 6 "
        f"--output-len 3 --disable-tqdm --output-json {out_json}"
    ).split()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "continuous batching:" not in captured.err  # --disable-tqdm
    assert "| continuous batching |" in captured.out and "one at a time" not in captured.out
    assert "floors: none" in captured.out
    report = json.loads(out_json.read_text())
    assert report["benchmark"] == "throughput"
    assert report["commit"] == "0123abc (the device copy)"
    assert report["results"][0]["output_tokens"] == 12
    assert report["results"][0]["floor_s"] is None


def test_bench_reports_a_prompt_that_does_not_fit(checkpoint, capsys):
    argv = (
        f"bench latency --model {checkpoint('mamba2')} --device cpu --max-model-len 16 "
        "--input-len 20 --num-iters 1 --num-iters-warmup 0 --disable-tqdm"
    ).split()
    assert main(argv) == 2
    assert "max_model_len is 16" in capsys.readouterr().err


def test_llm_generate_shows_a_progress_bar_unless_told_not_to(checkpoint, capsys):
    llm = LLM(checkpoint("mamba2"), **CPU)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(["a", "b", "c"], params)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "3/3" in err and "tok/s" in err
    llm.generate(["a"], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_dtype_of_the_costs_follows_the_engine(checkpoint):
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("mamba2"), device="cpu", dtype="bfloat16", mamba_ssm_cache_dtype="auto"
        )
    )
    costs = engine_costs(engine)
    hf = transformers.AutoModelForCausalLM.from_config(engine.model_config.hf_config)
    params = sum(p.numel() for p in hf.parameters())
    assert costs.weight_bytes == (params - costs.head_params) * 2  # untied: no lookup table
    mixer = engine.model_config.hf_config
    d_inner = mixer.num_heads * mixer.head_dim
    conv = (d_inner + 2 * mixer.n_groups * mixer.state_size) * (mixer.conv_kernel - 1)
    ssm = d_inner * mixer.state_size
    assert costs.state_bytes_per_seq == mixer.num_hidden_layers * (conv + ssm) * 2


def test_long_outputs_runs_the_largest_batch_the_cache_holds(checkpoint, tmp_path):
    """benchmarks/long_outputs.py: the batch is the most full-length requests whose KV
    blocks and state slots the engine's cache budget holds (the planner, asked for one
    more, gives fewer blocks than they need), every request runs in the timed window, and
    the report compares the first model with the last."""
    bench = load_benchmark("long_outputs")
    budget, shape = 12 * 2**20, ["--input-len", "16", "--output-len", "112", "--context", "40"]
    report = bench.main(
        ["--models", checkpoint("bamba"), checkpoint("llama"), "--window", "3", *shape]
        + ["--device", "cpu", "--dtype", "float32", "--cache-memory", str(budget)]
        + ["--json", str(tmp_path / "long.json")]
    )
    rows = report["rows"]
    assert [r["model"] for r in rows] == [Path(checkpoint(m)).name for m in ("bamba", "llama")]
    for model, row in zip(("bamba", "llama"), rows, strict=True):
        assert row["running"] == row["batch"] > 1
        assert (row["full_gc_collections"] > 0) == (row["full_gc_s"] > 0)
        more = LLMEngine(
            EngineConfig(
                model=checkpoint(model),
                max_model_len=128,
                max_num_seqs=row["batch"] + 1,
                cache_memory=budget,
                enable_prefix_caching=False,
                **CPU,
            )
        )
        blocks_each = -(-128 // more.config.block_size)
        fits = min(more.scheduler.max_num_seqs, more.cache_plan.num_kv_blocks // blocks_each)
        # One more does not fit (its state slot may cost blocks another request needed).
        assert fits <= row["batch"], (model, fits, row["batch"])
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    key = f"{rows[0]['model']}_over_{rows[1]['model']}_output_tok_s_float32"
    assert report[key] == pytest.approx(ratio)
    assert json.loads((tmp_path / "long.json").read_text())["rows"] == rows


def test_state_precision_measures_16_bit_state_against_float32(tmp_path):
    """benchmarks/state_precision.py on the bundled model: one row per variant, every
    position of every sequence measured, float32 against float32 in another batch ~0,
    and 16-bit state a real, small difference (bfloat16's 8 bits more than float16's 11)."""
    bench = load_benchmark("state_precision")
    out = tmp_path / "state_precision.json"
    report = bench.main(
        ["--num-tokens", "40", "--prompt-len", "8", "--num-seqs", "2", "--output", str(out)]
        + ["--device", "cpu", "--dtype", "float32"]
    )
    rows = report["rows"]
    assert [(r["state_dtype"], r["rounding"]) for r in rows] == [
        ("float32", "nearest"),
        ("bfloat16", "nearest"),
        ("bfloat16", "stochastic"),
        ("float16", "nearest"),
        ("float16", "stochastic"),
    ]
    assert {r["positions"] for r in rows} == {2 * 39}
    noise, variants = rows[0], rows[1:]
    assert noise["max_abs_dlogprob"] < 1e-4 and noise["greedy_agreement"] == 1.0
    for r in variants:
        assert 0 < r["mean_abs_dlogprob"] <= r["p99_abs_dlogprob"] <= r["max_abs_dlogprob"] < 0.5
        assert len(r["mean_abs_dlogprob_by_window"]) == bench.WINDOWS
    by_name = {r["variant"]: r for r in rows}
    assert by_name["bfloat16"]["mean_abs_dlogprob"] > by_name["float16"]["mean_abs_dlogprob"]
    assert len(report["table"].splitlines()) == 2 + len(rows)
    assert json.loads(out.read_text())["rows"] == rows
    assert report["meta"]["command"] and report["num_tokens"] == 40


def test_decode_profile_times_a_built_decode_step_without_prefilling(checkpoint, tmp_path):
    """benchmarks/decode_profile.py: a decode step of `batch` requests at `context` tokens,
    built from the engine's pools, runs through the engine's model runner; the report has
    the shape asked for, its bytes and FLOPs, a time per step, and a per-op breakdown that
    adds up to its busy time."""
    bench = load_benchmark("decode_profile")
    out = tmp_path / "profile.json"
    report = bench.main(
        ["--model", checkpoint("bamba"), "--batch-size", "3", "--context", "21", "--iters", "2"]
        + ["--profile", "--profile-iters", "1", "--device", "cpu", "--dtype", "float32"]
        + ["--cache-memory", str(24 * 2**20), "--json", str(out)]
        + ["--attention-decode-config", '{"mask_skip": false}']
    )
    assert json.loads(out.read_text())["step_ms"] == report["step_ms"] > 0
    assert (report["batch_size"], report["context"], report["graph"]) == (3, 21, False)
    assert report["attention_decode_config"] == {"mask_skip": False}
    assert report["bytes"] > 0 and report["flops"] > 0
    kernels = report["kernels"]
    assert (
        kernels
        and abs(sum(k["us"] for k in kernels) - report["busy_us"]) < 1e-6 * report["busy_us"] + 1e-9
    )
    assert any(k["kernel"] == "aten::mm" for k in kernels)


@pytest.mark.parametrize("sample", ["greedy", "temperature"])
def test_decode_profile_samples_each_step_when_asked(checkpoint, monkeypatch, sample):
    """--sample: every step (3 warm-up, then --iters a round) launches the sampler on that
    step's logits, one row a request, greedy or at temperature 1."""
    from ssmserve.engine.sampler import Sampler

    seen = []
    launch = Sampler.launch

    def recording_launch(self, logits, rows, generator, logits_rows=None):
        seen.append((tuple(logits.shape), [r.params.temperature for r in rows]))
        return launch(self, logits, rows, generator, logits_rows)

    monkeypatch.setattr(Sampler, "launch", recording_launch)
    bench = load_benchmark("decode_profile")
    report = bench.main(
        ["--model", checkpoint("bamba"), "--batch-size", "2", "--context", "9", "--iters", "2"]
        + ["--rounds", "1", "--sample", sample, "--device", "cpu", "--dtype", "float32"]
        + ["--cache-memory", str(24 * 2**20)]
    )
    temperature = 0.0 if sample == "greedy" else 1.0
    assert len(seen) == 3 + 2
    assert all(shape[0] == 2 and temps == [temperature] * 2 for shape, temps in seen)
    assert report["sample"] == sample and report["step_ms"] > 0


def test_decode_profile_sets_the_decode_attention_launch_parameters_for_its_run():
    """--attention-decode-config: its keys over the decode attention's defaults while the
    run lasts (a call's own config still wins), the defaults back after; an unknown key
    is a usage error before any model loads."""
    from ssmserve.kernels import paged_attention

    bench = load_benchmark("decode_profile")
    shape = (1, 8, 4, 128, 256, torch.device("cpu"))  # one split of 4 tiles: mask_skip on
    before = paged_attention.decode_launch_config(*shape)
    with bench.decode_attention_overrides({"mask_skip": False, "num_warps": 8}):
        cfg = paged_attention.decode_launch_config(*shape, {"num_warps": 2}, True)
        assert cfg["mask_skip"] is False and cfg["num_warps"] == 2
        rest = ("mask_skip", "num_warps", "prefetch")  # prefetch follows the PDL argument
        assert {k: v for k, v in cfg.items() if k not in rest} == {
            k: v for k, v in before.items() if k not in rest
        }
    assert paged_attention.decode_launch_config(*shape) == before
    assert before["mask_skip"] is True
    with pytest.raises(SystemExit):
        bench.main(["--attention-decode-config", '{"nope": 1}'])


def test_decode_profile_sets_the_gemv_launch_parameters_for_its_run():
    """--gemv-config: as --attention-decode-config, for the one-row GEMV."""
    from ssmserve.kernels import gemv

    bench = load_benchmark("decode_profile")
    shape = (4096, 2560, torch.device("cpu"))
    before = gemv.gemv_launch_config(*shape)
    with bench.launch_overrides(gemv, "gemv_launch_config", {"num_warps": 8}):
        assert gemv.gemv_launch_config(*shape) == {**before, "num_warps": 8}
        assert gemv.gemv_launch_config(*shape, {"num_warps": 4}) == before
    assert gemv.gemv_launch_config(*shape) == before and before["num_warps"] == 4
    with pytest.raises(SystemExit):
        bench.main(["--gemv-config", '{"num_warps": 3}'])


def test_decode_profile_times_variants_in_turn_each_under_its_own_launch_parameters(
    checkpoint, monkeypatch
):
    """--variants: every step of a variant (its warm-up, then one turn of --iters steps a
    round) runs inside that variant's launch parameters, the variants taking turns; the
    report gives each variant's rounds and their median, and the first one's as step_ms.
    A bad variant is a usage error before any model loads."""
    from ssmserve.engine.model_runner import ModelRunner
    from ssmserve.kernels import gemv, paged_attention

    seen = []
    execute = ModelRunner.execute

    def recording_execute(self, *args, **kwargs):
        attention = paged_attention.decode_launch_config(1, 8, 4, 128, 256, torch.device("cpu"))
        seen.append((gemv.gemv_launch_config(64, 64, torch.device("cpu"))["num_warps"],
                     attention["num_warps"]))  # fmt: skip
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    bench = load_benchmark("decode_profile")
    variants = [{}, {"gemv": {"num_warps": 8}, "attention": {"num_warps": 2}}]
    report = bench.main(
        ["--model", checkpoint("bamba"), "--batch-size", "2", "--context", "9", "--iters", "2"]
        + ["--rounds", "2", "--variants", json.dumps(variants), "--device", "cpu"]
        + ["--dtype", "float32", "--cache-memory", str(24 * 2**20)]
    )
    default = (
        4,
        paged_attention.decode_launch_config(1, 8, 4, 128, 256, torch.device("cpu"))["num_warps"],
    )
    other = (8, 2)
    assert default[1] != 2
    assert seen == [default] * 3 + [other] * 3 + ([default] * 2 + [other] * 2) * 2
    got = report["variants"]
    assert [(v["gemv"], v["attention"]) for v in got] == [({}, {}), tuple(variants[1].values())]
    for v in got:
        assert len(v["rounds_ms"]) == 2 and min(v["rounds_ms"]) <= v["step_ms"] <= max(
            v["rounds_ms"]
        )
    assert report["step_ms"] == got[0]["step_ms"]
    for bad in ['[{"gemv": {"nope": 1}}]', '[{"other": {}}]', "[]", '{"gemv": {}}']:
        with pytest.raises(SystemExit):
            bench.main(["--variants", bad])
    with pytest.raises(SystemExit):
        bench.main(["--variants", "[{}]", "--gemv-config", '{"num_warps": 8}'])


@pytest.mark.parametrize("overlap", ["--overlap-steps", "--no-overlap-steps"])
def test_step_overhead_times_the_steady_steps_against_their_forward(checkpoint, tmp_path, overlap):
    """benchmarks/step_overhead.py: 4 prompts of 8 tokens, 16 tokens a step, prefix caching
    on (a prompt's last token in a step after the rest). Step 1 prefills 7 + 7 tokens of
    the first two prompts and 2 of the third; step 2 samples the first two's first tokens
    and prefills 5 of the third and 7 of the fourth; step 3 samples all four. The first two
    have their 30th token at step 31, so steps 3 to 31 advance all four: 29 steady steps,
    of which 2 + 2 are dropped, with the engine's steps overlapped (each call returns the
    step before's tokens) or not. The forward replayed is a decode of all four, and the
    overhead is step minus forward."""
    bench = load_benchmark("step_overhead")
    out = tmp_path / "step_overhead.json"
    report = bench.main(
        ["--model", checkpoint("bamba"), "--num-requests", "4", "--input-len", "8"]
        + ["--output-len", "30", "--skip-first", "2", "--skip-last", "2", "--forward-iters", "2"]
        + ["--max-num-batched-tokens", "16", "--enable-prefix-caching", overlap]
        + ["--device", "cpu", "--dtype", "float32", "--cache-memory", str(24 * 2**20)]
        + ["--disable-tqdm", "--json", str(out)]
    )
    assert (report["steady_steps"], report["steady_steps_used"]) == (29, 25)
    assert (report["forward_batch"], report["graph"], report["preemptions"]) == (4, False, 0)
    assert report["step_ms"] > 0 and report["forward_ms"] > 0
    assert report["overhead_ms"] == report["step_ms"] - report["forward_ms"]
    assert json.loads(out.read_text()) == report


def test_prefill_profile_splits_a_prompts_ttft_and_its_steps(checkpoint, tmp_path):
    """benchmarks/prefill_profile.py, a 40-token prompt with prefix caching on and off: a
    TTFT and a busy time whose op rows add up to it; with caching on, the SSM state before
    the last token is kept, so the prefill stops one token short and the last token takes
    a step of its own (39 + 1); off, one step of 40."""
    bench = load_benchmark("prefill_profile")
    step_tokens = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / f"prefill{caching}.json"
        report = bench.main(
            ["--model", checkpoint("bamba"), "--input-len", "40", "--warmup", "1", caching]
            + ["--iters", "3", "--device", "cpu", "--dtype", "float32"]
            + ["--cache-memory", str(24 * 2**20), "--json", str(out)]
        )
        assert json.loads(out.read_text()) == report
        assert report["prefix_caching"] == (caching == "--enable-prefix-caching")
        samples = report["ttft_samples_ms"]
        assert len(samples) == 3 and report["ttft_ms"] == sorted(samples)[1]
        assert report["ttft_ms"] > 0 and report["busy_ms"] > 0 and report["kernels"] > 0
        busy_us = sum(r["us"] for r in report["kernel_rows"])
        assert busy_us == pytest.approx(1e3 * report["busy_ms"], rel=1e-9)
        assert report["host_share"] == pytest.approx(1 - report["busy_ms"] / report["ttft_ms"])
        assert report["steps"] == len(report["step_tokens"])
        step_tokens[report["prefix_caching"]] = report["step_tokens"]
    assert step_tokens == {True: [39, 1], False: [40]}


def test_hybrid_vs_llama_gathers_each_measure_from_its_file(tmp_path):
    """benchmarks/hybrid_vs_llama.py on published H200 results: each figure is the one its
    source file holds (read here from the file itself), beside the issue's target, and a
    measure given twice is refused."""
    bench = load_benchmark("hybrid_vs_llama")
    results = ROOT / "benchmarks" / "results"
    names = [
        "long_outputs_2026-12-02_h200.json",
        "long_outputs_2026-12-05_h200_bf16_state.json",
        "latency_2026-12-05_h200_mamba-2.8b_b1_2k.json",
        "latency_2026-12-01d_h200_bamba9b_prefill_32k.json",
        "step_overhead_2026-12-05_h200_bamba-9b_256.json",
        "throughput_2026-12-02_h200_llama-3-8b_256x1k1k.json",
        "prefill_profile_2026-12-06_h100_bamba-9b_32k_gqa.json",  # not a tracked measure
    ]
    run = tmp_path / "run"
    run.mkdir()
    for name in names:
        (run / name).write_bytes((results / name).read_bytes())
    # Bamba's b256 decode forward counts at short context only: the 5k profile is left,
    # the same at 1.5k taken (its context and a floor edited in: an H100 file has none).
    name = "decode_profile_2026-12-06_h100_bamba-9b_b256_5k_pdl.json"
    profile = {**json.loads((results / name).read_text()), "floor_ms": 30.0}
    (run / "profile_5k.json").write_text(json.dumps(profile))
    (run / "sub").mkdir()
    (run / "sub" / "profile_1.5k.json").write_text(json.dumps({**profile, "context": 1536}))
    bench.main([str(run), "--out", str(tmp_path / "summary")])
    out = json.loads((tmp_path / "summary.json").read_text())
    measures = out["measures"]

    def source(name):
        return json.loads((results / name).read_text())

    long32, long16 = source(names[0]), source(names[1])
    assert out["bamba9b_over_llama8b_1k_8k_output_tok_s"] == pytest.approx(
        long32["bamba-9b_over_llama-3-8b_output_tok_s_float32"]
    )
    ratio16 = measures["bamba9b_over_llama8b_1k_8k_output_tok_s_16bit_state"]
    assert ratio16["value"] == pytest.approx(
        long16["bamba-9b_over_llama-3-8b_output_tok_s_bfloat16"]
    )
    assert ratio16["verdict"] == "missed" and ratio16["commit"] == long16["meta"]["commit"]
    mamba = source(names[2])["results"]
    assert out["decode_batch1_ms"]["mamba-2.8b"] == pytest.approx(
        mamba["summary_s"]["decode_per_token"]["p50"] * 1e3
    )
    assert measures["decode_batch1_ms.mamba-2.8b"]["floor"] == pytest.approx(
        mamba["floors_s"]["decode_per_token"] * 1e3
    )
    assert out["decode_batch1_ms"]["bamba-9b"] is None
    assert measures["decode_batch1_ms.bamba-9b"]["verdict"] == "not measured"
    ttft = source(names[3])["results"]["summary_s"]["ttft"]["p50"]
    assert measures["ttft_s.32768"]["value"] == pytest.approx(ttft)
    assert measures["ttft_s.32768"]["verdict"] == ("met" if ttft <= 1.0 else "missed")
    assert out["step_overhead_ms_batch256"] == source(names[4])["overhead_ms"]
    assert measures["step_overhead_ms_batch256"]["verdict"] == "met"
    row = source(names[5])["results"][0]
    llama = measures["throughput_256x1k1k_output_tok_s.llama-3-8b"]
    assert llama["value"] == pytest.approx(row["output_tokens"] / row["seconds"])
    forward = measures["decode_forward_over_floor.bamba-9b_b256"]
    assert forward["value"] == pytest.approx(profile["step_ms"] / profile["floor_ms"])
    assert forward["file"] == "profile_1.5k.json" and forward["target"] == "<= 1.15"
    assert forward["verdict"].startswith("none (target is for an H200; ran on NVIDIA H100")
    assert "| step_overhead_ms_batch256 | <= 1 |" in (tmp_path / "summary.md").read_text()
    (run / "again.json").write_bytes((results / names[2]).read_bytes())
    with pytest.raises(SystemExit, match="decode_batch1_ms.mamba-2.8b is given by"):
        bench.main([str(run), "--out", str(tmp_path / "summary")])
