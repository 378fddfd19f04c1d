"""Attention data parallelism: N ranks behind one worker, each with its own scheduler, pools
and decode-facing endpoints (docs/parallelism.md, "Attention data parallelism")."""
