"""TFDS builders: prepare from tiny fixtures in each public format, read back, clear errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from sage_jax.data import builders, sources
from sage_jax.data.sources import DataFormatError, ManualFileMissingError

tfds.disable_progress_bar()

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after \"Answer:\"."


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _dapo_row(i, problem, answer):
    return {"data_source": "math_dapo",
            "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"uuid-{i}"}}


def write_fixtures(manual):
    """One tiny file per dataset, in the release's own format; returns the expected records."""
    dapo = [_dapo_row(0, "What is $1+1$?", "2"), _dapo_row(1, "Find $x$ if $2x=6$.", "3"),
            _dapo_row(0, "What is $1+1$?", "2")]  # the release repeats its prompts
    _parquet(manual / "dapo_math_17k" / "data" / "dapo-math-17k.parquet", dapo)  # the hub's own layout
    _parquet(manual / "dapo_math_17k_en" / "en" / "train-00000-of-00001.parquet", [  # open-r1's processed en
        {"prompt": "What is $1+1$?", "solution": "2", "data_source": "math_dapo"},
        {"prompt": "Find $x$ if $2x=6$.", "solution": "3", "data_source": "math_dapo"}])
    _jsonl(manual / "math500" / "test.jsonl", [
        {"problem": "Compute $\\frac12+\\frac12$.", "solution": "It is $\\boxed{1}$.",
         "answer": "1", "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
        {"problem": "Solve $x^2=4$, $x>0$.", "solution": "$x=\\boxed{2}$", "answer": "2",
         "subject": "Algebra", "level": 3, "unique_id": "test/algebra/2.json"}])
    _parquet(manual / "aime2024" / "aime_2024_problems.parquet", [
        {"ID": "2024-I-1", "Problem": "AIME problem one.", "Solution": "sol one", "Answer": 204},
        {"ID": "2024-II-4", "Problem": "AIME problem two.", "Solution": "sol two", "Answer": 33}])
    _jsonl(manual / "aime2025" / "test.jsonl", [
        {"problem": "AIME 2025 problem.", "answer": "70", "id": 0}])
    _parquet(manual / "amc23" / "test-00000-of-00001.parquet", [  # math-ai/amc23: float answers
        {"id": 0, "question": "AMC question?", "answer": 27.0, "url": "https://x"},
        {"id": 1, "question": "Another one?", "answer": 0.5, "url": "https://y"}])
    aime = manual / "aime_2024_2025" / "eval" / "data" / "aime"  # GAIR-NLP/AIME-Preview's layout and fields
    _jsonl(aime / "test2024.jsonl", [{"id": 60, "problem": "AIME 2024 one.", "solution": "s", "answer": "204",
                                      "url": "https://a"}])
    _jsonl(aime / "test2025-I.jsonl", [{"id": "I-1", "problem": "AIME 2025 I one.", "solution": "",
                                        "answer": "70", "url": ""}])
    _jsonl(aime / "test2025-II.jsonl", [{"id": "II-1", "problem": "AIME 2025 II one.", "answer": "588"}])
    _jsonl(manual / "minerva_math" / "test.jsonl", [
        {"problem": "Minerva problem.", "solution": "so \\boxed{9.8\\,m/s^2}", "type": "Physics",
         "idx": 3}])
    return {
        "dapo_math_17k": [("uuid-0", "What is $1+1$?", "2", ""), ("uuid-1", "Find $x$ if $2x=6$.", "3", "")],
        "dapo_math_17k_en": [("1", "What is $1+1$?", "2", ""), ("2", "Find $x$ if $2x=6$.", "3", "")],
        "math500": [("test/algebra/1.json", "Compute $\\frac12+\\frac12$.", "1", "It is $\\boxed{1}$."),
                    ("test/algebra/2.json", "Solve $x^2=4$, $x>0$.", "2", "$x=\\boxed{2}$")],
        "aime2024": [("2024-I-1", "AIME problem one.", "204", "sol one"),
                     ("2024-II-4", "AIME problem two.", "33", "sol two")],
        "aime2025": [("0", "AIME 2025 problem.", "70", "")],
        "amc23": [("0", "AMC question?", "27", ""), ("1", "Another one?", "0.5", "")],
        "aime_2024_2025": [("60", "AIME 2024 one.", "204", "s"), ("I-1", "AIME 2025 I one.", "70", ""),
                           ("II-1", "AIME 2025 II one.", "588", "")],
        "minerva_math": [("3", "Minerva problem.", "9.8\\,m/s^2", "so \\boxed{9.8\\,m/s^2}")],
    }


def test_every_builder_prepares_from_local_files(tmp_path):
    expected = write_fixtures(tmp_path / "manual")
    for name, want in expected.items():
        split = sources.SPECS[name].split
        ds = builders.load_split(name, split, data_dir=tmp_path / "data",
                                 manual_dir=tmp_path / "manual")
        got = [sources.decode_record(ds[i]) for i in range(len(ds))]
        assert [(r["id"], r["problem"], r["answer"], r["solution"]) for r in got] == want, name
        assert all(r["source"] == name for r in got)
        # The same files, read back without the builder object (no TensorFlow involved).
        again = tfds.data_source(name, data_dir=str(tmp_path / "data"), download=False)[split]
        assert sources.decode_record(again[0]) == got[0]
    math500 = builders.load_split("math500", "test", tmp_path / "data", tmp_path / "manual")
    assert sources.decode_record(math500[1])["level"] == 3
    assert sources.decode_record(math500[1])["subject"] == "Algebra"


def test_missing_file_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    manual = tmp_path / "manual"
    manual.mkdir()
    with pytest.raises(ManualFileMissingError) as e:
        builders.load_split("math500", "test", tmp_path / "data", manual)
    msg = str(e.value)
    assert str(manual / "math500" / "test.jsonl") in msg
    assert "huggingface.co/datasets/HuggingFaceH4/MATH-500" in msg and "answer" in msg
    with pytest.raises(ManualFileMissingError, match="dapo-math-17k.parquet"):
        builders.load_split("dapo_math_17k", "train", tmp_path / "data", manual)


def test_malformed_rows_name_the_file_and_row(tmp_path):
    manual = tmp_path / "manual"
    bad = manual / "aime2025" / "test.jsonl"
    _jsonl(bad, [{"problem": "ok", "answer": "1"}, {"problem": "no answer here"}])
    with pytest.raises(DataFormatError) as e:
        builders.load_split("aime2025", "test", tmp_path / "data", manual)
    assert str(bad) in str(e.value) and "row 2" in str(e.value) and "'answer'" in str(e.value)

    broken = tmp_path / "m2" / "amc23" / "test.jsonl"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"question": "q", "answer": 1}\n{"question": \n')
    with pytest.raises(DataFormatError, match=r"test.jsonl: row 2: not valid JSON"):
        list(sources.records_from_file(sources.SPECS["amc23"], broken))

    dapo = tmp_path / "m3" / "dapo-math-17k.parquet"
    _parquet(dapo, [_dapo_row(0, "fine", "1"), {**_dapo_row(1, "x", "2"), "reward_model": None}])
    with pytest.raises(DataFormatError, match=r"dapo-math-17k.parquet: row 2: .*reward_model"):
        list(sources.records_from_file(sources.SPECS["dapo_math_17k"], dapo))


def test_rows_of_the_wrong_type_are_refused_not_stringified(tmp_path):
    """A list problem or a dict answer names the file, the row and the field (they were stringified before)."""
    manual = tmp_path / "manual"
    bad = manual / "math500" / "test.jsonl"
    row = {"problem": "2*2", "answer": "4", "solution": "", "unique_id": "p1", "subject": "x", "level": 1}
    for field, value in (("problem", ["2*2", "x"]), ("answer", {"v": 4})):
        _jsonl(bad, [row, {**row, "unique_id": "p2", field: value}])
        with pytest.raises(DataFormatError) as e:
            builders.load_split("math500", "test", tmp_path / f"data_{field}", manual)
        assert str(bad) in str(e.value) and "row 2" in str(e.value) and f"'{field}'" in str(e.value), str(e.value)
    _jsonl(bad, [row, {**row, "unique_id": "p2", "answer": [4, 5]}])  # several golds stay allowed
    src = builders.load_split("math500", "test", tmp_path / "data_golds", manual)
    assert sources.decode_record(src[1])["answer"] == "4, 5"


def test_a_non_parquet_file_names_itself(tmp_path):
    bad = tmp_path / "manual" / "amc23" / "test-00000-of-00001.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(DataFormatError, match="test-00000-of-00001.parquet: not a readable parquet file"):
        builders.load_split("amc23", "test", tmp_path / "data", tmp_path / "manual")


def test_a_changed_source_file_is_prepared_again(tmp_path):
    """The prepared copy is keyed on the source files' content: an edited answer or a replaced file is read,
    never the stale copy (the second call returned the old answers before)."""
    manual = tmp_path / "manual"
    f = manual / "math500" / "test.jsonl"
    rows = [{"problem": f"{a}*{a}", "answer": str(a * a), "unique_id": f"p{a}"} for a in range(2, 6)]
    _jsonl(f, rows)
    answers = lambda: [sources.decode_record(r)["answer"]
                       for r in builders.load_split("math500", "test", tmp_path / "data", manual)]
    assert answers() == ["4", "9", "16", "25"]
    rows[1]["answer"] = "10"
    _jsonl(f, rows)
    assert answers() == ["4", "10", "16", "25"]
    _jsonl(f, rows + [{"problem": "6*6", "answer": "36", "unique_id": "p6"}])  # a replaced file, one row more
    assert answers() == ["4", "10", "16", "25", "36"]
    assert answers() == ["4", "10", "16", "25", "36"]  # unchanged: the prepared copy is read as it is


def test_procedural_builder_splits_are_disjoint(tmp_path):
    cfg = builders.arithmetic_config(max_value=6, num_train=300, num_test=40, seed=3)
    b = builders.get_builder("procedural_arithmetic", tmp_path, config=cfg)
    b.download_and_prepare()
    train, test = b.as_data_source("train"), b.as_data_source("test")
    assert (len(train), len(test)) == (300, 40)
    tr = {sources.decode_record(train[i])["problem"] for i in range(len(train))}
    te = {sources.decode_record(test[i])["problem"] for i in range(len(test))}
    assert len(tr) == 300 and len(te) == 40 and not tr & te
    rec = sources.decode_record(train[0])
    assert rec["solution"].endswith("\\boxed{%s}" % rec["answer"])
    # Different knobs get a different config name, hence different prepared data.
    assert builders.arithmetic_config(max_value=7).name != builders.arithmetic_config().name


def test_hub_download_is_used_when_no_local_file(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, repo_type, local_dir):
        calls.append((repo_id, filename, repo_type))
        path = tmp_path / "hub" / filename
        _jsonl(path, [{"id": 7, "question": "From the hub?", "answer": "5"}])
        return str(path)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("SAGE_JAX_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    ds = builders.load_split("aime2025", "test", tmp_path / "data", tmp_path / "empty_manual")
    assert calls == [("math-ai/aime25", "test.jsonl", "dataset")]
    assert sources.decode_record(ds[0])["problem"] == "From the hub?"


def test_files_off_the_hub_download_from_their_urls(tmp_path, monkeypatch):
    """The pooled AIME set lives on GitHub: fetched from its raw URLs, written whole or not at all."""
    import urllib.request

    calls = []

    def fake_retrieve(url, dest):
        calls.append(url)
        if "II" in url:
            raise OSError("connection reset")
        _jsonl(tmp_path / "x", [{"id": len(calls), "problem": f"P{len(calls)}", "answer": "1"}])
        (tmp_path / "x").rename(dest)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("SAGE_JAX_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlretrieve", fake_retrieve)
    with pytest.raises(ManualFileMissingError, match="connection reset") as e:
        builders.load_split("aime_2024_2025", "test", tmp_path / "data", tmp_path / "manual")
    base = "https://raw.githubusercontent.com/GAIR-NLP/AIME-Preview/main/eval/data/aime/"
    assert calls == [base + "test2024.jsonl", base + "test2025-I.jsonl", base + "test2025-II.jsonl"]
    assert base + "test2025-II.jsonl" in str(e.value)
    assert len(list(tmp_path.rglob("test2025-I.jsonl"))) == 1  # the file that arrived
    assert not list(tmp_path.rglob("test2025-II.jsonl"))  # the broken one is not taken for the file


def test_unknown_names_splits_and_empty_files_are_one_line_errors(tmp_path):
    with pytest.raises(sources.DataConfigError, match="unknown dataset 'gsm8k'"):
        builders.get_builder("gsm8k")
    with pytest.raises(sources.DataConfigError, match="no builder config 'huge'"):
        builders.get_builder("procedural_arithmetic", tmp_path, config="huge")
    manual = tmp_path / "manual"
    _jsonl(manual / "aime2025" / "test.jsonl", [{"problem": "ok", "answer": "1"}])
    with pytest.raises(sources.DataConfigError, match=r"no split 'train'.*\['test'\]"):
        builders.load_split("aime2025", "train", tmp_path / "data", manual)
    empty = tmp_path / "m2" / "amc23" / "test.jsonl"
    empty.parent.mkdir(parents=True)
    empty.write_text("")
    with pytest.raises(DataFormatError, match=r"test.jsonl: no rows") as e:
        builders.load_split("amc23", "test", tmp_path / "data2", tmp_path / "m2")
    assert "\n" not in str(e.value)
