"""Fuzzing the user-input parsers: any input gives a result or a one-line user error.

Never a traceback: ``load_config`` raises only :class:`ConfigError`, ``load_jsonl`` only
:class:`DataError`, each with a single-line message.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gspo.config import ConfigError, TrainConfig, describe_fields, load_config
from gspo.data import DataError, load_jsonl
from gspo.data.tasks import Example

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

LEAF_KEYS = [k for k, _, _ in describe_fields()]
TOP_KEYS = sorted({k.split(".")[0] for k in LEAF_KEYS})
SUB_KEYS = sorted({k.split(".", 1)[1] for k in LEAF_KEYS if "." in k})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10, 10),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["1e-3", "nan", "inf", "-1", "0", "true", "group", "token", "hf",
                     "arithmetic", "jsonl", "+", "*", "float32", "r2", "tiny:llama", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
key_text = st.one_of(st.sampled_from(TOP_KEYS + SUB_KEYS), st.text(max_size=10))
section = st.dictionaries(st.one_of(st.sampled_from(SUB_KEYS), st.text(max_size=10)), values,
                          max_size=4)
documents = st.dictionaries(key_text, st.one_of(values, section), max_size=6)


def _assert_one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg, f"empty message from {type(e).__name__}"
    assert len(msg.splitlines()) == 1, repr(msg)
    return msg


def _check_load(path: Path | None, overrides: list[str]) -> None:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _assert_one_line(e)
    else:
        assert isinstance(cfg, TrainConfig)


# ----------------------------------------------------------------------------- (a) YAML files


@FUZZ
@given(doc=st.one_of(documents, values))
def test_fuzz_yaml_documents(tmp_path, doc):
    p = tmp_path / "fuzz.yaml"
    p.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    _check_load(p, [])


yaml_alphabet = st.sampled_from([*string.printable, "é", "\u2028", "\x85", "\ufeff"])
yaml_text = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=yaml_alphabet, max_size=200),
    st.lists(st.tuples(st.sampled_from(LEAF_KEYS + TOP_KEYS), st.text(yaml_alphabet, max_size=15)),
             max_size=6).map(lambda kv: "".join(f"{k}: {v}\n" for k, v in kv)),
    st.sampled_from(["model: 2001-13-45\n", "seed: !!int x\n", "progress: !!bool maybe\n",
                     "steps: !!timestamp never\n", "steps: !!float 1\n", "a: *unknown\n",
                     "? [1, 2]\n: 3\n", "task: !!set {1, 2}\n", "steps: " + "9" * 5000 + "\n",
                     "optim: {lr: " + "9" * 400 + "}\n", "[" * 200 + "]" * 200]),
)


@FUZZ
@given(data=st.one_of(yaml_text.map(lambda t: t.encode("utf-8", errors="surrogatepass")),
                      st.binary(max_size=300)))
def test_fuzz_yaml_text_and_bytes(tmp_path, data):
    p = tmp_path / "fuzz.yaml"
    p.write_bytes(data)
    _check_load(p, [])


# ----------------------------------------------------------------------------- (b) overrides

override_value = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=yaml_alphabet, max_size=30),
    values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
    st.sampled_from(["2001-13-45", "!!bool x", "!!int y", "!!timestamp z", "[1", "{a:", "*x",
                     "9" * 400, "9" * 5000, "1e999", "-1e999", ".nan", "~", ""]),
)
override = st.one_of(
    st.text(max_size=40),
    st.tuples(st.one_of(st.sampled_from(LEAF_KEYS + TOP_KEYS), st.text(max_size=12)),
              override_value).map(lambda kv: f"{kv[0]}={kv[1]}"),
)


@FUZZ
@given(overrides=st.lists(override, max_size=4))
def test_fuzz_overrides(overrides):
    _check_load(None, overrides)


# ----------------------------------------------------------------------------- (c) JSONL

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=15)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
json_rows = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), json_values),
                           "answer": json_values},
                          optional={"level": json_values, "extra": json_values}),
    json_values,
)
jsonl_line = st.one_of(
    json_rows.map(lambda r: json.dumps(r, ensure_ascii=False)),
    json_rows.map(json.dumps),
    st.text(max_size=40),
    st.sampled_from(["", "   ", "{", "[1, 2]", '{"prompt": "x"}', '{"answer": 1}',
                     '{"prompt": "", "answer": 1}', '{"prompt": "a\u2028b", "answer": 2}',
                     "9" * 5000, "[" * 5000, '{"prompt": "p", "answer": ' + "9" * 5000 + "}"]),
)
ROW_ERROR = re.compile(r":(\d+): ")


def _check_jsonl(p: Path, n_lines: int) -> None:
    try:
        rows = load_jsonl(str(p))
    except DataError as e:
        msg = _assert_one_line(e)
        assert msg.startswith(str(p)), msg
        rest = msg[len(str(p)):]
        m = ROW_ERROR.match(rest)
        if m:
            assert 1 <= int(m.group(1)) <= n_lines, msg
        else:
            assert rest in (": not UTF-8 text", ": dataset is empty"), msg
    else:
        assert rows and all(isinstance(r, Example) for r in rows)
        assert all(isinstance(r.prompt, str) and r.prompt.strip() for r in rows)
        assert all(isinstance(r.answer, str) for r in rows)


jsonl_files = st.one_of(
    st.tuples(st.lists(jsonl_line, max_size=6), st.sampled_from(["\n", "\r\n"])).map(
        lambda t: t[1].join(t[0]).encode("utf-8", errors="surrogatepass")),
    st.binary(max_size=200),
)


@FUZZ
@given(data=jsonl_files)
def test_fuzz_jsonl(tmp_path, data):
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes(data)
    # Universal newlines: \r\n, \r and \n each end a line, so this bounds the line count.
    _check_jsonl(p, data.count(b"\n") + data.count(b"\r") + 1)


def test_jsonl_valid_rows_roundtrip(tmp_path):
    p = tmp_path / "ok.jsonl"
    rows = [{"prompt": "a\u2028b", "answer": 3, "level": 1}, {"prompt": "q", "answer": "x"}]
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    out = load_jsonl(str(p))
    assert [(r.prompt, r.answer, r.columns) for r in out] == [
        ("a\u2028b", "3", {"level": 1}), ("q", "x", {"level": None})]
