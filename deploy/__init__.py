"""deploy: the `deepinfer` command line, the Ray launcher and cluster configs (YAML validated by the
config models). No serving logic lives here."""
