"""The launcher process: pre-flight checks, starting the supervisor (or a node agent, or an etcd
coordinator) that starts the workers, the run's report and its exit code."""
