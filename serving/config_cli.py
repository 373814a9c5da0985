"""Command lines generated from a frozen pydantic config model (one `--flag` per field), shared by
every process entry point so defaults and help text live in the config model alone.

Every parser also takes the process-wide TLS flags (`--tls-cert`, `--tls-key`, `--tls-ca`,
`--tls-server-name`): they set the environment `serving.auth` reads, so every gRPC server and client
channel of the process (and of the processes it starts) uses them."""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import BaseModel, ValidationError


def make_parser(config_cls: type[BaseModel], prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one `--flag` per config field (defaults and help from the model).

    A field whose `json_schema_extra` names `cli_choices` (e.g. a backend registry's names) gets those
    as the flag's choices.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, field in config_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("cli_choices"):
            parser.add_argument(flag, dest=name, type=annotation, choices=list(extra["cli_choices"]),
                                default=field.default, help=f"{field.description} (default: {field.default})")
            continue
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=field.default,
                                help=field.description)
        elif typing.get_origin(annotation) is typing.Literal:
            choices = typing.get_args(annotation)
            parser.add_argument(flag, dest=name, type=type(choices[0]), choices=choices, default=field.default,
                                help=f"{field.description} (default: {field.default})")
        else:
            parser.add_argument(flag, dest=name, type=annotation, default=field.default,
                                help=f"{field.description} (default: {field.default})")
    _add_tls_flags(parser, config_cls)
    return parser


_TLS_HELP = {
    "tls_cert": "PEM certificate (chain) of this process's gRPC server: it serves TLS only (default: $DEEPINFER_TLS_CERT)",
    "tls_key": "PEM private key of --tls-cert (default: $DEEPINFER_TLS_KEY)",
    "tls_ca": "PEM CA bundle the clients of this process check servers against; with it (or --tls-cert) every "
              "internal call is TLS (default: $DEEPINFER_TLS_CA, else the system roots)",
    "tls_server_name": "name expected in every server certificate instead of the dialled host "
                       "(default: $DEEPINFER_TLS_SERVER_NAME)",
}


def _add_tls_flags(parser: argparse.ArgumentParser, config_cls: type[BaseModel]) -> None:
    # NOTE: process settings, not config fields: every channel and server of the process takes them from
    # its environment (`serving.auth.tls_settings`), which is also how `deepinfer up` hands them on
    from deepinfer.serving.auth import TLS_FLAGS

    group = parser.add_argument_group("TLS (serving.auth; default: plaintext)")
    for name in TLS_FLAGS:
        if name not in config_cls.model_fields:
            group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="PATH"
                               if name != "tls_server_name" else "NAME", help=_TLS_HELP[name])


def config_from_args(config_cls: type[BaseModel], parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parse `argv` into a validated `config_cls`; exits with the validation message on bad values."""
    args = vars(parser.parse_args(argv))
    tls = {name: args.pop(name) for name in _TLS_HELP if name in args and name not in config_cls.model_fields}
    if any(tls.values()):
        from deepinfer.serving.auth import set_tls

        try:
            set_tls(tls["tls_cert"], tls["tls_key"], tls["tls_ca"], tls["tls_server_name"])
        except RuntimeError as e:
            parser.error(str(e))
    try:
        return config_cls(**args)
    except ValidationError as e:
        parser.error(str(e))
