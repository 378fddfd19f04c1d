"""``python -m prefill_worker`` runs the CLI."""

from prefill_worker.service.cli import main

raise SystemExit(main())
