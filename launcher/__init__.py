"""Recipe-driven launcher: YAML recipe + key=value overrides -> a supervised, fault-tolerant run."""
