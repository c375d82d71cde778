"""Gather the figures issue #16 tracks into one summary: the JSONs `benchmarks/h200.sh`
writes (or any `bench latency`, `bench throughput`, `long_outputs.py` and
`step_overhead.py` JSONs), found under the given folders, become
`<out>.json` and `<out>.md`: each figure beside its target and floor, with the file,
commit and command it came from.

    python3 benchmarks/hybrid_vs_llama.py DIR [DIR ...] \
        --out benchmarks/results/hybrid_vs_llama_DATE_h200

What a file is comes from its own fields (the benchmark, the shape), not its name. Two
files of one measure are an error: name the folders of one run. A measure no file gives
stays null in the JSON and "not measured" in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# The targets of issue #16 (H200, bf16 weights): measure -> (target, "<=" or ">=").
TARGETS: dict[str, tuple[float, str]] = {
    "step_overhead_ms_batch256": (1.0, "<="),
    "decode_batch1_ms.bamba-9b": (4.9, "<="),
    "decode_batch1_ms.llama-3-8b": (3.9, "<="),
    "decode_batch1_ms.mamba2-2.7b": (1.8, "<="),
    "decode_batch1_ms.mamba-2.8b": (2.0, "<="),
    "bamba9b_over_llama8b_1k_8k_output_tok_s": (2.0, ">="),
    "bamba9b_over_llama8b_1k_8k_output_tok_s_16bit_state": (3.0, ">="),
    "decode_forward_over_floor.bamba-9b_b256": (1.15, "<="),
    "long_outputs_over_floor.bamba-9b": (1.3, "<="),
    "long_outputs_over_floor.bamba-9b_16bit_state": (1.3, "<="),
    "long_outputs_over_floor.llama-3-8b": (1.3, "<="),
    "throughput_256x1k1k_output_tok_s.llama-3-8b": (8000.0, ">="),
    "throughput_256x1k1k_output_tok_s.bamba-9b": (6500.0, ">="),
    "ttft_s.32768": (1.0, "<="),
    "ttft_s.131072": (4.5, "<="),
}


def model_name(path: str) -> str:
    return Path(path).name


class Summary:
    def __init__(self) -> None:
        # measure -> {"value", "floor", then where it came from: "file", "commit", ...}
        self.measures: dict[str, dict[str, Any]] = {}

    def value(self, key: str) -> float | None:
        return self.measures.get(key, {}).get("value")

    def put(self, key: str, value: float, source: Path, meta: dict, floor: float | None = None):
        if key in self.measures:
            raise SystemExit(
                f"{key} is given by {self.measures[key]['file']} and by {source}: name the "
                "folders of one run"
            )
        self.measures[key] = {
            "value": value,
            "floor": floor,
            "file": source.name,
            "commit": meta.get("commit"),
            "command": meta.get("command"),
            "device": meta.get("device"),
            "date": meta.get("date"),
        }

    def read(self, path: Path) -> None:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            return
        if data.get("benchmark") == "latency":
            self._latency(path, data)
        elif data.get("benchmark") == "throughput":
            self._throughput(path, data)
        elif "rows" in data and "shape" in data:
            self._long_outputs(path, data)
        elif "floor_ms" in data and "batch_size" in data:
            self._decode_profile(path, data)
        elif "overhead_ms" in data and "meta" in data:
            n = data["num_requests"]
            self.put(f"step_overhead_ms_batch{n}", data["overhead_ms"], path, data["meta"])

    def _latency(self, path: Path, data: dict) -> None:
        params, results = data["params"], data["results"]
        model = model_name(data["model"]["path"])
        summary, floors = results["summary_s"], results.get("floors_s") or {}
        if params["batch_size"] != 1:
            return
        if params["output_len"] == 1 and model == "bamba-9b":
            key = f"ttft_s.{params['input_len']}"
            self.put(key, summary["ttft"]["p50"], path, data, floors.get("ttft"))
        elif params["input_len"] == 2048 and summary.get("decode_per_token"):
            floor = floors.get("decode_per_token")
            self.put(
                f"decode_batch1_ms.{model}",
                summary["decode_per_token"]["p50"] * 1e3,
                path,
                data,
                None if floor is None else floor * 1e3,
            )

    def _decode_profile(self, path: Path, data: dict) -> None:
        """Bamba-9B's decode forward at batch 256 with float32 state at short context
        (the issue's ~1.5k; `decode_profile.py`), against its byte floor."""
        shape = (model_name(data["model"]), data["batch_size"], data["state_dtype"])
        if shape != ("bamba-9b", 256, "float32") or data["context"] > 2048:
            return
        if data["floor_ms"] is None:  # a device without measured peaks
            return
        key = "decode_forward_over_floor.bamba-9b_b256"
        self.put(key, data["step_ms"] / data["floor_ms"], path, data["meta"], data["floor_ms"])

    def _throughput(self, path: Path, data: dict) -> None:
        params = data["params"]
        if (params["num_prompts"], params["input_len"], params["output_len"]) != (256, 1024, 1024):
            return
        row = data["results"][0]
        model = model_name(data["model"]["path"])
        self.put(
            f"throughput_256x1k1k_output_tok_s.{model}",
            row["output_tokens"] / row["seconds"],
            path,
            data,
        )

    def _long_outputs(self, path: Path, data: dict) -> None:
        """Bamba's rows against the Llama row of the same run; a run of 16-bit state
        alone (no float32 row) names its Llama row so too."""
        rows = {(r["model"], r["state_dtype"]): r for r in data["rows"]}
        llama = next((r for (m, _), r in rows.items() if m == "llama-3-8b"), None)
        has_fp32 = any(dtype == "float32" for _, dtype in rows)
        meta = data["meta"]
        for (model, dtype), row in rows.items():
            if model == "llama-3-8b":
                suffix = "" if has_fp32 else "_beside_16bit_state"
            else:
                suffix = "" if dtype == "float32" else "_16bit_state"
            key = f"long_outputs_over_floor.{model}{suffix}"
            self.put(key, row["over_floor"], path, meta, row["floor_step_ms"])
            if model == "bamba-9b" and llama is not None:
                ratio = row["output_tok_s"] / llama["output_tok_s"]
                self.put(f"bamba9b_over_llama8b_1k_8k_output_tok_s{suffix}", ratio, path, meta)


def verdict(key: str, value: float | None, device: str | None) -> str:
    """Against the issue's target, which is an H200's: another card's figure gets none."""
    if key not in TARGETS:
        return ""
    if value is None:
        return "not measured"
    if device and "H200" not in device:
        return f"none (target is for an H200; ran on {device})"
    target, op = TARGETS[key]
    met = value <= target if op == "<=" else value >= target
    return "met" if met else "missed"


def render(summary: Summary) -> tuple[dict, str]:
    measures = {}
    for key in sorted(set(TARGETS) | set(summary.measures)):
        m = summary.measures.get(key, {"value": None, "floor": None})
        target = None if key not in TARGETS else f"{TARGETS[key][1]} {TARGETS[key][0]:g}"
        judged = verdict(key, m["value"], m.get("device"))
        measures[key] = {**m, "target": target, "verdict": judged}
    out: dict[str, Any] = {
        "bamba9b_over_llama8b_1k_8k_output_tok_s": summary.value(
            "bamba9b_over_llama8b_1k_8k_output_tok_s"
        ),
        "step_overhead_ms_batch256": summary.value("step_overhead_ms_batch256"),
        "decode_batch1_ms": {
            m: summary.value(f"decode_batch1_ms.{m}")
            for m in ("bamba-9b", "llama-3-8b", "mamba2-2.7b", "mamba-2.8b")
        },
        "measures": measures,
    }
    lines = [
        "| measure | target | value | floor | verdict | file (commit) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, m in out["measures"].items():
        value = "–" if m["value"] is None else f"{m['value']:.4g}"
        floor = "–" if m["floor"] is None else f"{m['floor']:.4g}"
        source = "–" if "file" not in m else f"`{m['file']}` ({m['commit']})"
        target, verdict_ = m["target"] or "–", m["verdict"] or "–"
        lines.append(f"| {key} | {target} | {value} | {floor} | {verdict_} | {source} |")
    return out, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="folders searched for JSONs")
    parser.add_argument("--out", type=Path, required=True, help="path without .json / .md")
    args = parser.parse_args(argv)
    summary = Summary()
    for folder in args.dirs:
        for path in sorted(folder.rglob("*.json")):
            summary.read(path)
    out, table = render(summary)
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
