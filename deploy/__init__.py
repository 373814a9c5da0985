"""deploy: the `deepinfer` command line, the Ray launcher and cluster configs (YAML validated by the
config models). No serving logic lives here."""

import os as _os
import sys as _sys
from pathlib import Path as _Path

if "ray" not in _sys.modules and "RAY_AUTH_MODE" not in _os.environ and (_Path.home() / ".ray" / "auth_token").exists():
    # NOTE: a local Ray cluster started by `ray.init()` uses token auth with ~/.ray/auth_token; a driver
    # joining it (`deepinfer status`, ...) sends that token only in token mode, which Ray reads when it
    # is imported -- so this is set here, before any deploy module imports ray (and never after: a
    # process whose Ray already read its mode must not see another one).
    _os.environ["RAY_AUTH_MODE"] = "token"
