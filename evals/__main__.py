"""`python -m deepinfer.evals ...` is `python -m deepinfer.evals.run ...`."""

import sys

from deepinfer.evals.run import main

sys.exit(main())
