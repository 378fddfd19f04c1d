"""The tensor-parallel group behind one worker: rank processes, the step broadcast, failing
as one (docs/parallelism.md, "The group behind one worker")."""
