"""The recipe's parallelism as arithmetic, read by both processes: the mesh's sizes and each
rank's coordinates (mesh.py, over checkpointless.protocol.Layout), and the pipeline's split of
the layers into stages and of the step into microbatches (pipeline_split.py). No torch
operation here."""
