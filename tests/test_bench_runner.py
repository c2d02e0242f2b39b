"""bench/run.py, the benchmark runner: its suites name scripts and options that exist, a run writes one JSON result
per suite with the machine, the revision and the load, ``--compare`` reaches the parts that serve earlier revisions,
and ``--table`` turns the results into docs/benchmarks.md's rows. No real benchmark runs here: the end-to-end tests
drive the runner with a small script of their own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from doccheck import REPO, script_options

sys.path.insert(0, str(REPO / "bench"))
import run  # noqa: E402
import suites  # noqa: E402

FAKE = '''
import argparse, json, time
ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=1)
ap.add_argument("--compare", nargs="*", default=[])
ap.add_argument("--fail", action="store_true")
ap.add_argument("--out")
a = ap.parse_args()
print("measuring", a.rounds, "rounds", flush=True)
if a.fail:
    raise SystemExit(3)
servers = {"octo": {"rps": 100.0}, **{f"octo@{r}": {"rps": 90.0} for r in a.compare}}
json.dump({"rounds": a.rounds, "servers": servers, "ratio_to_bare": 0.5}, open(a.out, "w"))
'''


def fake_suite(tmp_path: Path, *parts: suites.Part) -> suites.Suite:
    return suites.Suite("fake", "a suite of the test's own", parts)


def fake_part(tmp_path: Path, name: str = "one", **kw) -> suites.Part:
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE)
    kw.setdefault("rows", lambda r: [("requests/s", f"{r['servers']['octo']['rps']:.0f}")])
    kw.setdefault("full", ("--rounds", "3"))
    kw.setdefault("quick", ("--rounds", "1"))
    return suites.Part(name, str(script), "what the fake measures", **kw)


@pytest.fixture
def results(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    monkeypatch.setattr(run, "RESULTS", folder)
    return folder


def test_every_part_names_a_script_and_options_it_has():
    bad = []
    for suite in suites.SUITES.values():
        for part in suite.parts:
            script = REPO / "bench" / part.script
            if not script.is_file():
                bad.append(f"{suite.name}/{part.name}: bench/{part.script} does not exist")
                continue
            declared = script_options(script)
            wanted = {a for a in (*part.full, *part.quick, *part.compare_args(["abc1234"])) if a.startswith("--")}
            bad += [f"{suite.name}/{part.name}: bench/{part.script} has no option {o}" for o in
                    sorted(wanted | {"--out"}) if o not in declared and "--" + o[5:] not in declared]  # --no-X
    assert not bad, "\n".join(bad)


def test_the_suites_the_docs_promise_exist_and_every_script_belongs_to_one():
    assert {"gateway", "streams", "agent", "startup", "speech", "vision"} <= set(suites.SUITES)
    used = {p.script for s in suites.SUITES.values() for p in s.parts}
    helpers = {"run.py", "suites.py", "revtree.py", "llama_server.py", "agent_capture.py"}
    tracked = subprocess.run(["git", "ls-files", "bench/*.py"], cwd=REPO, capture_output=True, text=True).stdout.split()
    loose = sorted(Path(p).name for p in tracked if (REPO / p).exists() and Path(p).name not in used | helpers)
    assert not loose, f"scripts in bench/ that no suite runs (fold them into one, or delete them): {loose}"


def test_no_result_file_is_named_after_anything_but_a_suite():
    names = {p.stem for p in (REPO / "bench" / "results").glob("*")} if (REPO / "bench/results").exists() else set()
    assert names <= set(suites.SUITES), sorted(names - set(suites.SUITES))


def test_a_run_writes_one_result_per_suite_with_the_machine_the_revision_and_the_load(tmp_path, results, monkeypatch):
    monkeypatch.setitem(run.SUITES, "fake", fake_suite(tmp_path, fake_part(tmp_path)))
    assert run.main(["fake", "--no-lock"]) == 0
    doc = json.loads((results / "fake.json").read_text())
    assert doc["suite"] == "fake" and doc["mode"] == "full"
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["cpu"] and "amx" in doc["machine"]
    assert doc["octo"]["commit"] and isinstance(doc["octo"]["local_changes"], bool)
    part = doc["parts"]["one"]
    assert part["result"]["rounds"] == 3 and part["command"].endswith("--rounds 3")
    assert part["rows"] == [["requests/s", "100"]]
    assert {"load_before", "load_median", "busy"} <= set(part["load"]) and part["date"].endswith("Z")
    assert run.main(["fake", "--no-lock", "--quick", "--out", str(tmp_path / "q.json")]) == 0
    assert json.loads((tmp_path / "q.json").read_text())["parts"]["one"]["result"]["rounds"] == 1
    assert json.loads((results / "fake.json").read_text())["mode"] == "full"  # --out leaves the result alone


def test_compare_reaches_the_parts_that_serve_revisions(tmp_path, results, monkeypatch):
    both = fake_suite(tmp_path, fake_part(tmp_path, "serves"), fake_part(tmp_path, "alone", compare=None))
    monkeypatch.setitem(run.SUITES, "fake", both)
    assert run.main(["fake", "--no-lock", "--compare", "HEAD"]) == 0
    doc = json.loads((results / "fake.json").read_text())
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    assert doc["compare"] == [head]
    assert f"octo@{head}" in doc["parts"]["serves"]["result"]["servers"]
    assert doc["parts"]["alone"]["result"]["servers"].keys() == {"octo"}
    assert "not supported" in doc["parts"]["alone"]["compare"]
    with pytest.raises(SystemExit):
        run.main(["fake", "--no-lock", "--compare", "no-such-revision-here"])


def test_append_style_compare_options_repeat_the_option():
    part = suites.Part("p", "x.py", "w", compare="append:--octo-rev")
    assert part.compare_args(["a", "b"]) == ["--octo-rev", "a", "--octo-rev", "b"]
    assert suites.Part("p", "x.py", "w").compare_args(["a", "b"]) == ["--compare", "a", "b"]
    assert part.compare_args([]) == []


def test_a_failing_or_missing_part_is_recorded_and_the_others_run(tmp_path, results, monkeypatch):
    parts = (fake_part(tmp_path, "fails", full=("--fail",)), fake_part(tmp_path, "missing", needs=("no_such_mod_x",)),
             fake_part(tmp_path, "works"))
    monkeypatch.setitem(run.SUITES, "fake", fake_suite(tmp_path, *parts))
    assert run.main(["fake", "--no-lock"]) == 1
    doc = json.loads((results / "fake.json").read_text())
    assert doc["parts"]["fails"]["error"] == "exit status 3"
    assert "measuring 1 rounds" in "\n".join(doc["parts"]["fails"]["log_tail"])
    assert "no_such_mod_x" in doc["parts"]["missing"]["skipped"]
    assert doc["parts"]["works"]["result"]["rounds"] == 3


def test_only_reruns_a_part_and_keeps_the_others(tmp_path, results, monkeypatch):
    monkeypatch.setitem(run.SUITES, "fake", fake_suite(tmp_path, fake_part(tmp_path, "a"), fake_part(tmp_path, "b")))
    assert run.main(["fake", "--no-lock"]) == 0
    first = json.loads((results / "fake.json").read_text())
    assert run.main(["fake", "--no-lock", "--only", "b"]) == 0
    again = json.loads((results / "fake.json").read_text())
    assert again["parts"]["a"] == first["parts"]["a"] and again["parts"]["b"]["date"] >= first["parts"]["b"]["date"]
    assert again["parts"]["b"]["run"] == "bench/run.py fake --only b"
    # a kept part keeps the revision it measured, whatever revision measured the part run again
    older = {**first, "octo": {"commit": "abc1234", "local_changes": True}}
    older["parts"] = {k: {kk: vv for kk, vv in v.items() if kk != "octo"} for k, v in first["parts"].items()}
    (results / "fake.json").write_text(json.dumps(older))
    assert run.main(["fake", "--no-lock", "--only", "b"]) == 0
    again = json.loads((results / "fake.json").read_text())
    assert again["parts"]["a"]["octo"] == {"commit": "abc1234", "local_changes": True}
    assert again["parts"]["b"]["octo"] == again["octo"] != again["parts"]["a"]["octo"]
    assert run.main(["--table", str(results / "fake.json")]) == 0
    with pytest.raises(SystemExit):
        run.main(["fake", "--no-lock", "--only", "c"])


def test_the_table_gives_each_number_its_command_date_host_and_load(tmp_path, results, monkeypatch, capsys):
    monkeypatch.setitem(run.SUITES, "fake", fake_suite(tmp_path, fake_part(tmp_path)))
    assert run.main(["fake", "--no-lock", "--quick"]) == 0
    capsys.readouterr()
    assert run.main(["--table", str(results / "fake.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| what | result | command | measured |")
    row = lines[2]
    doc = json.loads((results / "fake.json").read_text())
    assert "| requests/s | 100 | `bench/run.py fake --quick` |" in row
    assert doc["parts"]["one"]["date"][:10] in row and f"{doc['machine']['cpus']}-core" in row
    assert "load" in row and "quick run" in row and ("busy host" in row or "quiet host" in row)


def test_the_real_summaries_read_the_results_the_scripts_write():
    """Each part's rows from a result shaped as its script writes it (a trimmed real one)."""
    overhead = {"concurrency": {"8": {"octo": {"ratio_rps": 0.7, "ratio_range": [0.6, 0.8], "rps": 6000.0,
                                               "cpu_us_per_request": 150.0},
                                      "octo@abc1234": {"ratio_rps": 0.8, "cpu_us_per_request": 130.0},
                                      "bare": {"rps": 9000.0, "cpu_us_per_request": 55.0}}}}
    (what, value), = suites.overhead_rows(overhead)
    assert "concurrency 8" in what and value.startswith("0.70x") and "octo@abc1234 0.80x (130 µs)" in value
    paired = {"levels": {"8": {"paired_decode_ratio": 0.98, "paired_e2e_ratio": 0.99, "octo_ahead_rounds": 3,
                               "rounds": 6, "decode_tok_s": {"octo": 70.0, "llama-server": 71.0}}}}
    assert "0.980x" in suites.paired_rows(paired)[0][1]
    startup = {"median_s": {"llama_server": 1.0, "octo_warm": 1.2},
               "quietest_s": {"llama_server": 0.9, "octo_warm": 1.1},
               "ratio_to_llama_server": {"octo_warm": {"median": 1.2, "quietest": 1.22}}}
    assert any("1.20x" in v for _, v in suites.startup_rows(startup))
    assert suites.generic_rows({"a": {"speedup": 1.5, "other": 2}}) == [("a speedup", "1.5")]
    assert "no summary" in run.rows_of(suites.Part("p", "x.py", "w", rows=suites.paired_rows), {"levels": 3})[0][1]


def test_list_describes_every_suite_and_part_with_its_time():
    text = run.listing()
    for suite in suites.SUITES.values():
        assert f"{suite.name}: " in text
        for part in suite.parts:
            assert f"bench/{part.script}" in text
    assert "min quick" in text and "[no --compare]" in text


def test_the_load_watch_reports_what_others_keep_busy():
    with run.LoadWatch(every=0.05) as watch:
        end = __import__("time").monotonic() + 0.3
        while __import__("time").monotonic() < end:
            pass
    rep = watch.report()
    assert rep["others_cores"] >= 0 and isinstance(rep["busy"], bool)
    assert run.describe({"cpus": 2, "cpu": "X", "vm": True, "avx512": True, "amx": False, "memory_gib": 24.0}) == \
        "2-core X VM, AVX-512, no AMX, 24 GiB"
