"""The PNG of a serving run (matplotlib, the optional extra `plot`): latency CDFs and
throughput over time, drawn from the results `bench serving` writes as JSON."""

from __future__ import annotations

from typing import Any


def plot_serving(results: dict[str, Any], path: str) -> None:
    """Write `path` (PNG) from `results` (the "results" of a `bench serving` report)."""
    from matplotlib.figure import Figure

    done = [r for r in results["per_request"] if r["error"] is None]
    series = {
        "TTFT": [r["ttft"] for r in done],
        "TPOT": [
            (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
            for r in done
            if r["output_tokens"] > 1
        ],
        "end to end": [r["e2e"] for r in done],
    }
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    cdf, rate = fig.subplots(1, 2)
    for label, values in series.items():
        values = sorted(1e3 * v for v in values)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            cdf.step(values, fractions, where="post", label=f"{label} ({len(values)} requests)")
    itl = results["itl_cdf_s"]
    if itl:
        cdf.plot([1e3 * v for v in itl], [q / 100 for q in range(len(itl))], label="ITL")
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction at or below")
    cdf.set_title(f"latency CDF, {len(done)} requests")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()

    line = results["timeline"]
    centers = [(i + 0.5) * line["bin_s"] for i in range(len(line["output_tokens_per_s"]))]
    rate.plot(centers, line["output_tokens_per_s"], color="tab:blue")
    rate.set_xlabel("time since the first request (s)")
    rate.set_ylabel("output tokens/s", color="tab:blue")
    rate.set_title("throughput over time")
    rate.grid(True, alpha=0.3)
    busy = rate.twinx()
    busy.plot(centers, line["requests_in_flight"], color="tab:orange")
    busy.set_ylabel("requests in flight (mean)", color="tab:orange")
    busy.set_ylim(bottom=0)
    fig.savefig(path, dpi=110)
