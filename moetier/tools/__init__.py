"""Tools around the engine: synthetic checkpoints (`moetier synth`) and the benchmark (`moetier bench`)."""
