"""Reading a local copy of a data set: JSONL, JSON, CSV or Parquet rows, each with where it came from.

Every row keeps its location (`file:line` for JSONL and CSV, `file:row N` for JSON and Parquet), so a
task that finds a field missing or malformed raises `DataError` naming the file, the line and the
field. Parquet needs pyarrow, which the core install does not carry: without it a Parquet file is
refused with the package to install (JSONL and CSV always work).
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "json", "csv", "parquet")
"""Accepted file formats, chosen by the file's suffix (`.ndjson` reads as JSONL)."""


class DataError(ValueError):
    """A data file that cannot be used: the message names the file, the line (or row) and the field."""

    def __init__(self, message: str, *, where: str, field: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if field is None else f"{where}: field {field!r}: {message}")
        self.where = where
        self.field = field


@dataclass(frozen=True)
class Row:
    """One record of a data file and where it is (`file:line` or `file:row N`)."""

    where: str
    fields: dict[str, Any]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def require(self, *names: str) -> tuple[str, Any]:
        """`(name, value)` of the first of `names` the row has with a non-empty value; raises `DataError`
        naming them all otherwise (the data sets publish one field under a few spellings)."""
        for name in names:
            value = self.fields.get(name)
            if value is not None and not (isinstance(value, str) and not value.strip()):
                return name, value
        present = ", ".join(sorted(map(str, self.fields))) or "none"
        shown = " or ".join(repr(n) for n in names)
        if any(n in self.fields for n in names):
            raise DataError(f"{shown} is empty", where=self.where, field=names[0])
        raise DataError(f"missing (expected {shown}; the record has: {present})", where=self.where, field=names[0])


def file_format(path: Path) -> str:
    """The format of `path` by its suffix; raises `DataError` for an unknown one."""
    suffix = path.suffix.lower().lstrip(".")
    if suffix == "ndjson":
        return "jsonl"
    if suffix not in FORMATS:
        raise DataError(f"unknown file type {path.suffix!r}; use one of .jsonl, .json, .csv, .parquet", where=str(path))
    return suffix


def read_rows(path: str | Path) -> list[Row]:
    """Every record of the data file at `path`; raises `DataError` (file and line named) for a file that is
    missing, empty, or not in its format."""
    path = Path(path)
    if not path.is_file():
        raise DataError("no such file (the data sets are not shipped: see evals/README.md for where to get them)",
                        where=str(path))
    kind = file_format(path)
    rows = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "parquet": _read_parquet}[kind](path)
    if not rows:
        raise DataError("the file holds no records", where=str(path))
    return rows


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"not a JSON object ({e})", where=where) from None
            if not isinstance(record, dict):
                raise DataError(f"a JSONL line must be a JSON object, got {type(record).__name__}", where=where)
            rows.append(Row(where, record))
    return rows


def _read_json(path: Path) -> list[Row]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"not valid JSON ({e})", where=str(path)) from None
    if isinstance(data, dict):  # {"data": [...]} / {"test": [...]}: the one list of records it holds
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError("a JSON file must hold a list of records (or an object with exactly one such list)",
                            where=str(path))
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"a JSON file must hold a list of records, got {type(data).__name__}", where=str(path))
    rows = []
    for i, record in enumerate(data):
        where = f"{path}:row {i + 1}"
        if not isinstance(record, dict):
            raise DataError(f"a record must be a JSON object, got {type(record).__name__}", where=where)
        rows.append(Row(where, record))
    return rows


def _read_csv(path: Path) -> list[Row]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # HLE / GPQA texts exceed the 128 KiB default
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise DataError("the CSV file has no header line", where=str(path))
        rows = []
        try:
            for record in reader:
                # NOTE: line_num is the line the record *ends* on (a quoted field may span lines)
                where = f"{path}:{reader.line_num}"
                if None in record:
                    raise DataError(f"{len(record[None])} more value(s) than the header's {len(reader.fieldnames)} "
                                    "columns", where=where)
                rows.append(Row(where, {k: v for k, v in record.items()}))
        except csv.Error as e:
            raise DataError(f"not valid CSV ({e})", where=f"{path}:{reader.line_num}") from None
    return rows


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs the pyarrow package, which deepinfer does not install: "
                        "`pip install pyarrow`, or convert the file to JSONL", where=str(path)) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and kin
        raise DataError(f"not a readable Parquet file ({e})", where=str(path)) from None
    return [Row(f"{path}:row {i + 1}", record) for i, record in enumerate(table.to_pylist())]

