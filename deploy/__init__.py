"""deploy: the `deepinfer` command line, the Ray launcher and cluster configs (YAML validated by the
config models). No serving logic lives here."""

import os as _os
from pathlib import Path as _Path

if "RAY_AUTH_MODE" not in _os.environ and (_Path.home() / ".ray" / "auth_token").exists():
    # NOTE: a local Ray cluster started by `ray.init()` uses token auth with ~/.ray/auth_token; a driver
    # joining it (`deepinfer status`, ...) sends that token only in token mode, which Ray reads when it
    # is imported -- so this is set here, before any deploy module imports ray.
    _os.environ["RAY_AUTH_MODE"] = "token"
