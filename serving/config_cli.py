"""Command lines generated from a frozen pydantic config model (one `--flag` per field), shared by
every process entry point so defaults and help text live in the config model alone."""

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
    return parser


def config_from_args(config_cls: type[BaseModel], parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parse `argv` into a validated `config_cls`; exits with the validation message on bad values."""
    args = parser.parse_args(argv)
    try:
        return config_cls(**vars(args))
    except ValidationError as e:
        parser.error(str(e))
