"""`python -m deepinfer ...` is the `deepinfer` CLI (deploy/cli.py)."""

from deepinfer.deploy.cli import main

raise SystemExit(main())
