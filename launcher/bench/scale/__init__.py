"""The scale harness: the real coordinator against thousands of simulated ranks on one machine
(`python -m launcher.bench.scale --help`), and the small probes beside it (store calls, etcd load,
relay latency)."""
