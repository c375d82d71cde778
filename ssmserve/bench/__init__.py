"""Benchmarks: offline latency and throughput over an engine, and a load generator for a
running server. Each prints a table (figures beside their physical floors where those can
be computed) and writes JSON; `ssmserve bench latency | throughput | serving` runs them."""
