"""Pipeline stages: which contiguous decoder layers each stage runs."""

from __future__ import annotations

from ssmserve.distributed.parallel import shard_range


def stage_layers(num_layers: int, config) -> list[range]:
    """The layers of each of `config.pipeline_parallel_size` stages: `pp_layer_partition`
    (layer counts, comma-separated) when given, else as even as possible."""
    pp = config.pipeline_parallel_size
    if config.pp_layer_partition:
        counts = [int(c) for c in config.pp_layer_partition.split(",")]
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"pp_layer_partition {config.pp_layer_partition!r} must give {pp} positive "
                f"layer counts that add up to the model's {num_layers} layers"
            )
    else:
        if pp > num_layers:
            raise ValueError(
                f"pipeline_parallel_size = {pp} is more than the model's {num_layers} layers"
            )
        counts = [len(shard_range(num_layers, pp, s)) for s in range(pp)]
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, counts)]
