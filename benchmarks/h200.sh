#!/usr/bin/env bash
# The GPU set behind benchmarks/results/: the GPU tests and the figures issue #16 tracks,
# each as the exact command that makes it, with random weights at real size
# (benchmarks/configs/, --load-format dummy). Run it from the repository root on one H200:
#
#     bash benchmarks/h200.sh COMMIT SECTION [SECTION ...]
#
# COMMIT is recorded in every JSON (the device's copy of the tree has no .git). Each
# section's JSON and log go to $OUT/SECTION/ (default benchmarks/results/raw/SECTION/),
# and with $OUT set, each section is also packed as $OUT/SECTION.tgz, one file per
# section; benchmarks/hybrid_vs_llama.py gathers their JSONs into the summary of the
# issue's targets. Sections run in the order given; one that fails is reported and the
# next one still runs. A device call runs ten minutes at most: give each call sections that fit.
# Rough wall times on one H200, model loading included (2026-12):
#
#   tests        GPU kernel, model and CUDA-graph tests (a call of its own)      ~5 min
#   quick        the GPU tests of the newest paths: the GEMV, norms at model
#                widths, PDL, conv and state updates, RoPE, decode attention, fused
#                Mamba2 decode, cuDNN merge, the decode graphs' inputs, the sampler's
#                draw, the residual and embedding norms, a Mamba model's first block,
#                RoPE inside decode attention, graph decode against eager        ~3 min
#   ceilings     the card's device-copy bandwidth and bf16 GEMM rate (the floors' peaks) ~1 min
#   kernels      state update (Mamba1 regrouped and Mamba2), MoE launch sizes, and the conv
#                update's launch parameters at 256 and 650 rows                   ~4 min
#   attention    the decode attention's launch parameters at batch 1, 8 and 64, with and
#                without PDL (prefetch, stages, mask_skip, 32-key tiles); a Llama-3-8B
#                b64 step at 5k with the defaults, with mask_skip forced on, with 32-key tiles ~3 min
#   b1           batch-1 decode step at 2k (graph replay) of Mamba2-2.7B, Mamba-2.8B,
#                Llama-3-8B, Bamba-9B, median of 3 rounds; VARIANTS (a JSON list's items,
#                as decode_profile --variants takes them) adds launch parameter sets that
#                take turns with the defaults in each model's process; SAMPLE (greedy or
#                temperature) has each step launch the sampler too                  ~2 min
#   pdl          bench_pdl.py's chains; batch-1 Mamba2-2.7B, Bamba-9B without and with PDL ~3 min
#   pdl2         the same for Mamba-2.8B and Llama-3-8B; Mamba2-2.7B profiles   ~3 min
#   pdl3         PDL beyond batch 1, with and without: Bamba-9B b256 fp32 state and
#                Llama-3-8B b64 decode steps at 5k; Mamba2-2.7B 2k prefill   ~4 min
#   latency      batch-1 decode at 2k: Bamba-9B, Llama-3-8B, Mamba2-2.7B, Mamba-2.8B ~5 min
#   prefill      one 2k prefill (Mamba2-2.7B, caching on / off); Bamba-9B TTFT 32k, 128k ~6 min
#   step         engine step minus forward, Bamba-9B at 256 running; Bamba b256 decode step
#                at 1.5k context (fp32 state); Bamba b484 decode profile          ~6 min
#   throughput   256 x 1k in / 1k out: Bamba-9B, Llama-3-8B, Jamba-Mini-1.7  ~8 min
#   long         1k in / 8k out at each model's largest batch, fp32 and bf16 state ~6 min
set -uo pipefail

if [ $# -lt 2 ]; then
    awk 'NR > 1 && /^set /{exit} NR > 1' "$0"  # the header above
    exit 2
fi
export SSMSERVE_COMMIT=$1
shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
results=${OUT:-benchmarks/results/raw}
configs=benchmarks/configs
dummy=(--load-format dummy)
failed=()

latency_b1() {  # model name [suffix engine-flags...]: decode at batch 1 after a 2k prompt
    local model=$1 suffix=${2:-}
    shift $(($# < 2 ? $# : 2))
    python3 -m ssmserve.cli bench latency --model "$configs/$model" "${dummy[@]}" --batch-size 1 \
        --input-len 2048 --output-len 64 --num-iters-warmup 1 --num-iters 3 --max-num-seqs 4 \
        --max-model-len 4096 --disable-tqdm --output-json "$dir/latency_${model}_b1_2k$suffix.json" "$@"
}

ttft() {  # tokens: Bamba-9B's time to first token for one prompt of that many tokens
    python3 -m ssmserve.cli bench latency --model "$configs/bamba-9b" "${dummy[@]}" \
        --batch-size 1 --input-len "$1" --output-len 1 --num-iters-warmup 1 --num-iters 2 \
        --max-num-seqs 2 --max-model-len $(($1 + 16)) --disable-tqdm \
        --output-json "$dir/latency_bamba-9b_prefill_$1.json"
}

throughput() {  # model name: 256 requests of 1k in / 1k out
    python3 -m ssmserve.cli bench throughput --model "$configs/$1" "${dummy[@]}" \
        --input-len 1024 --output-len 1024 --num-prompts 256 --disable-tqdm \
        --output-json "$dir/throughput_${1}_256x1k1k.json"
}

section() {
    case $1 in
    tests)
        python3 -m pytest -q -x tests/kernels tests/test_triton_models.py tests/test_cuda_graphs.py
        ;;
    quick)
        python3 -m pytest -q tests/kernels/test_gemv.py tests/kernels/test_attention_merge.py \
            tests/kernels/test_compile_for_gpu.py tests/kernels/test_bench_pdl.py \
            tests/kernels/test_triton_norm_attention.py tests/kernels/test_triton_state_update.py \
            tests/kernels/test_triton_conv1d.py tests/kernels/test_rotary_activation.py \
            tests/kernels/test_triton_mamba2_decode.py tests/kernels/test_decode_inputs.py \
            tests/kernels/test_sampling_draw.py tests/kernels/test_rotary_decode_attention.py \
            tests/test_triton_models.py tests/test_model_layer.py \
            tests/test_cuda_graphs.py -k "gemv or merge or pdl or cudnn or sm90 or model_widths \
            or update or rope or paged_attention or mamba2_decode or decode_inputs or draw \
            or rms_norm or first_block or graph_decode or two_launches or llama_sizes"
        ;;
    ceilings)
        python3 benchmarks/kernels/bench_ceilings.py --out "$dir/ceilings.json"
        ;;
    attention)
        python3 benchmarks/kernels/bench_paged_attention.py --sections sweep_decode \
            --out "$dir/paged_attention_h200.json" || return
        for cfg in '{}' '{"mask_skip": true}' '{"block_n": 32}'; do
            name=$(echo "$cfg" | tr -dc 'a-z0-9_')
            python3 benchmarks/decode_profile.py --model "$configs/llama-3-8b" "${dummy[@]}" \
                --batch-size 64 --context 5120 --iters 10 --attention-decode-config "$cfg" \
                --json "$dir/decode_profile_llama-3-8b_b64_5k_${name:-defaults}.json" || return
        done
        ;;
    kernels)
        python3 benchmarks/kernels/bench_state_update.py --sections accuracy,sizes \
            --out "$dir/state_update_h200.json" &&
            python3 benchmarks/kernels/bench_moe.py --sections sizes --out "$dir/moe_h200.json" &&
            python3 benchmarks/kernels/bench_conv1d.py --sections update,sweep_update \
                --out "$dir/conv1d_update_h200.json"
        ;;
    b1)
        for model in mamba2-2.7b mamba-2.8b llama-3-8b bamba-9b; do
            python3 benchmarks/decode_profile.py --model "$configs/$model" "${dummy[@]}" \
                --batch-size 1 --context 2048 --iters 200 --rounds 3 \
                --variants "[{}${VARIANTS:+, $VARIANTS}]" --sample "${SAMPLE:-none}" \
                --json "$dir/decode_profile_${model}_b1_2k${SAMPLE:+_$SAMPLE}.json" || return
        done
        ;;
    pdl)
        python3 benchmarks/kernels/bench_pdl.py --out "$dir/pdl_h200.json" &&
            for model in mamba2-2.7b bamba-9b; do
                latency_b1 $model _no_pdl --no-decode-pdl && latency_b1 $model _pdl --decode-pdl ||
                    return
            done
        ;;
    pdl2)
        for model in mamba-2.8b llama-3-8b; do
            latency_b1 $model _no_pdl --no-decode-pdl && latency_b1 $model _pdl --decode-pdl ||
                return
        done
        for flag in --no-decode-pdl --decode-pdl; do
            python3 benchmarks/decode_profile.py --model "$configs/mamba2-2.7b" "${dummy[@]}" \
                --batch-size 1 --context 2048 --profile --top 16 $flag \
                --json "$dir/decode_profile_mamba2-2.7b_b1_2k_${flag#--}.json" || return
        done
        ;;
    pdl3)
        for flag in --no-decode-pdl --decode-pdl; do
            for shape in "bamba-9b 256" "llama-3-8b 64"; do
                set -- $shape
                python3 benchmarks/decode_profile.py --model "$configs/$1" "${dummy[@]}" \
                    --batch-size "$2" --context 5120 --iters 10 --mamba-ssm-cache-dtype float32 \
                    $flag --json "$dir/decode_profile_$1_b$2_5k_${flag#--}.json" || return
            done
            python3 benchmarks/prefill_profile.py --model "$configs/mamba2-2.7b" "${dummy[@]}" \
                --input-len 2048 --max-model-len 4096 $flag \
                --json "$dir/prefill_profile_mamba2-2.7b_2k_${flag#--}.json" || return
        done
        ;;
    latency)
        for model in bamba-9b llama-3-8b mamba2-2.7b mamba-2.8b; do
            latency_b1 $model || return
        done
        ;;
    prefill)
        for caching in on off; do
            flag=--enable-prefix-caching
            [ $caching = on ] || flag=--no-enable-prefix-caching
            python3 benchmarks/prefill_profile.py --model "$configs/mamba2-2.7b" "${dummy[@]}" \
                --input-len 2048 $flag --max-model-len 4096 \
                --json "$dir/prefill_profile_mamba2-2.7b_2k_caching_$caching.json" || return
        done
        ttft 32768 && ttft 131072
        ;;
    step)
        python3 benchmarks/step_overhead.py --model "$configs/bamba-9b" "${dummy[@]}" \
            --num-requests 256 --input-len 1024 --output-len 160 --disable-tqdm \
            --json "$dir/step_overhead_bamba-9b_256.json" &&
            python3 benchmarks/decode_profile.py --model "$configs/bamba-9b" "${dummy[@]}" \
                --batch-size 256 --context 1536 --iters 10 --mamba-ssm-cache-dtype float32 \
                --json "$dir/decode_profile_bamba-9b_b256_1.5k.json" &&
            python3 benchmarks/decode_profile.py --model "$configs/bamba-9b" "${dummy[@]}" \
                --batch-size 484 --context 5120 --iters 5 --profile --profile-iters 2 --top 14 \
                --json "$dir/decode_profile_bamba-9b_b484_5k.json"
        ;;
    throughput)
        for model in bamba-9b llama-3-8b jamba-mini-1.7; do
            throughput $model || return
        done
        ;;
    long)
        python3 benchmarks/long_outputs.py "${dummy[@]}" --models "$configs/bamba-9b" \
            "$configs/llama-3-8b" --state-dtypes float32 bfloat16 --window 48 \
            --json "$dir/long_outputs_h200.json"
        ;;
    *)
        echo "unknown section $1 (see the head of $0)" >&2
        return 2
        ;;
    esac
}

for name in "$@"; do
    dir=$results/$name
    mkdir -p "$dir"
    echo "== $name ($(date -u +%H:%M:%S))"
    if ! (section "$name") 2>&1 | tee "$dir/log.txt"; then
        failed+=("$name")
    fi
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/$name.tgz" -C "$results" "$name"
        rm -rf "${dir:?}"
    fi
done
echo "== done ($(date -u +%H:%M:%S)); failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
