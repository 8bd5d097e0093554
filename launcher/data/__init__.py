"""Training data: prepared once per node by the launcher process (sources, tokenized cache, chat
examples) and sampled by each worker (`StepSampler`: a step's rows, a pure function of the step)."""
