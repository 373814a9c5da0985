"""Reading the data sets' published layouts, and bad files refused with the file, line and field named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deepinfer.evals.data import DataError, read_rows
from deepinfer.evals.tasks import NEEDS_JUDGE, SCORED, TASKS

FIXTURES = Path(__file__).parent / "fixtures"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_fixtures_load_in_their_published_layouts():
    aime = TASKS["aime"].load(FIXTURES / "aime_2026.jsonl")
    assert [(i.id, i.question, i.reference) for i in aime][:1] == [("1", "What is 37 + 48?", "85")]
    gpqa = TASKS["gpqa"].load(FIXTURES / "gpqa_diamond.csv")
    assert [i.id for i in gpqa] == ["recFixture0001", "recFixture0002", "recFixture0003"]
    assert gpqa[1].question.endswith('"surely"?') and gpqa[1].choices[0] == "its pressure"  # quoted, multi-line CSV
    hle = TASKS["hle"].load(FIXTURES / "hle.jsonl")
    assert [(i.kind, i.status, bool(i.images)) for i in hle] == [
        ("exact", SCORED, False), ("choice", SCORED, False), ("exact", NEEDS_JUDGE, False), ("exact", SCORED, True)]
    assert hle[1].letters == "ABCDE" and hle[1].reference == "B"


def test_aime_other_published_spellings(tmp_path):
    # opencompass/AIME2025: question/answer as text; Maxwell-Jia/AIME_2024: ID/Problem/Answer
    f = _write(tmp_path / "a.jsonl", '{"question": "Q1", "answer": "033"}\n\n{"ID": "2024-I-1", "Problem": "Q2", "Answer": 7}\n')
    items = TASKS["aime"].load(f)
    assert [(i.id, i.question, i.reference) for i in items] == [("#1", "Q1", "33"), ("2024-I-1", "Q2", "7")]
    j = _write(tmp_path / "a.json", json.dumps({"test": [{"problem": "Q", "answer": 5}]}))
    assert TASKS["aime"].load(j)[0].reference == "5"


@pytest.mark.parametrize("name, text, message", [
    ("missing.jsonl", None, "no such file"),
    ("a.txt", "x", "unknown file type '.txt'"),
    ("a.jsonl", "", "holds no records"),
    ("a.jsonl", '{"problem": "Q", "answer": 1}\n{"problem": "Q2", "answer": 2\n', "a.jsonl:2: not a JSON object"),
    ("a.jsonl", '[1, 2]\n', "a.jsonl:1: a JSONL line must be a JSON object"),
    ("a.jsonl", '{"problem": "Q", "answer": 1}\n{"answer": 2}\n',
     "a.jsonl:2: field 'problem': missing (expected 'problem' or 'question' or 'Problem' or 'Question'; the record has: answer)"),
    ("a.jsonl", '{"problem": "Q", "answer": "12a"}\n', "a.jsonl:1: field 'answer': must be an integer"),
    ("a.jsonl", '{"problem": "  ", "answer": 3}\n', "a.jsonl:1: field 'problem': 'problem' or 'question' or 'Problem' or 'Question' is empty"),
    ("a.jsonl", '{"id": "x", "problem": "Q", "answer": 1}\n{"id": "x", "problem": "Q", "answer": 2}\n',
     "a.jsonl:2: field 'id': duplicate item id 'x'"),
    ("a.json", '{"a": [], "b": []}', "exactly one such list"),
    ("a.json", '[{"problem": "Q", "answer": 1}, 3]', "a.json:row 2: a record must be a JSON object"),
])
def test_bad_aime_files_are_refused_clearly(tmp_path, name, text, message):
    path = tmp_path / name if text is None else _write(tmp_path / name, text)
    with pytest.raises(DataError) as e:
        TASKS["aime"].load(path)
    assert message in str(e.value)
    assert str(tmp_path) in str(e.value)


def test_bad_gpqa_files_are_refused_clearly(tmp_path):
    header = "Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3,Record ID\n"
    f = _write(tmp_path / "g.csv", header + "Q1,a,b,c,d,r1\nQ2,a,b,,d,r2\n")
    with pytest.raises(DataError, match=r"g\.csv:3: field 'Incorrect Answer 2': 'Incorrect Answer 2' is empty"):
        TASKS["gpqa"].load(f)
    f = _write(tmp_path / "g2.csv", "Question,Correct Answer\nQ1,a\n")
    with pytest.raises(DataError, match=r"g2\.csv:2: field 'Incorrect Answer 1': missing"):
        TASKS["gpqa"].load(f)
    f = _write(tmp_path / "g3.csv", header + "Q1,a,b,c,d,r1,extra\n")
    with pytest.raises(DataError, match=r"g3\.csv:2: 1 more value\(s\) than the header's 6 columns"):
        TASKS["gpqa"].load(f)


def test_bad_hle_files_are_refused_clearly(tmp_path):
    base = {"id": "a", "question": "Q", "image": "", "answer": "1"}
    f = _write(tmp_path / "h.jsonl", json.dumps({**base, "answer_type": "exactMatch"}) + "\n"
               + json.dumps({**base, "id": "b", "answer_type": "freeForm"}) + "\n")
    with pytest.raises(DataError, match=r"h\.jsonl:2: field 'answer_type': must be one of exactMatch, multipleChoice"):
        TASKS["hle"].load(f)
    f = _write(tmp_path / "h2.jsonl", json.dumps({**base, "answer_type": "exactMatch", "image": "http://x/y.png"}) + "\n")
    with pytest.raises(DataError, match=r"h2\.jsonl:1: field 'image': must be a base64 data URL"):
        TASKS["hle"].load(f)


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    f = _write(tmp_path / "hle.parquet", "not really parquet")
    with pytest.raises(DataError, match=r"hle\.parquet: reading Parquet needs the pyarrow package.*pip install pyarrow"):
        read_rows(f)


def test_hle_parquet_layout(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [json.loads(line) for line in (FIXTURES / "hle.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test-00000-of-00001.parquet")
    items = TASKS["hle"].load(tmp_path / "test-00000-of-00001.parquet")
    assert [i.id for i in items] == [r["id"] for r in rows]
    assert items[0].where.endswith("test-00000-of-00001.parquet:row 1")
