"""The translation wing's recorded studies: one file of runs, each made once, resumable (studies.RecordedRuns)."""

from __future__ import annotations

import json

import torch

from attention_core.translation import bottleneck, studies


def test_a_study_runs_what_is_missing_writes_after_each_run_and_resumes(tmp_path, capsys):
    path = tmp_path / "runs.json"
    assert studies.read_runs(path) == []
    made = []

    def run(k):
        def go():
            made.append(k)
            # every earlier run is on disk before the next one starts
            assert studies.read_runs(path) == [{"k": j, "v": j * j} for j in made[:-1]]
            return {"k": k, "v": k * k}
        return go

    study = studies.RecordedRuns(path, {"about": "squares"})
    rows = [study.ensure({"k": k}, run(k), lambda r: f"k={r['k']}") for k in (1, 2, 1)]
    assert made == [1, 2] and rows == [{"k": 1, "v": 1}, {"k": 2, "v": 4}, {"k": 1, "v": 1}]
    assert json.loads(path.read_text()) == {"about": "squares", "runs": [{"k": 1, "v": 1}, {"k": 2, "v": 4}]}
    assert [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()] == ["k=1", "k=2"]
    again = studies.RecordedRuns(path, {"about": "squares"})
    assert again.runs == study.runs
    again.ensure({"k": 2}, run(99), str)
    assert made == [1, 2]


def test_a_study_command_line_takes_out_and_trains_on_one_thread(tmp_path, monkeypatch):
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    study = studies.study_main(["--out", str(tmp_path / "s.json")], "d", tmp_path / "default.json", {"m": 1})
    assert threads == [1] and study.path == tmp_path / "s.json" and study.runs == [] and study.meta == {"m": 1}
    assert studies.study_main([], "d", tmp_path / "default.json", {}).path == tmp_path / "default.json"


def test_the_bottleneck_command_resumes_without_repeating_a_run(tmp_path, monkeypatch):
    out, made = tmp_path / "b.json", []

    def fake_run_one(name, seed, steps, hidden_dim, test=None):
        made.append((name, seed, steps, hidden_dim))
        return {"name": name, "seed": seed, "steps": steps, "hidden_dim": hidden_dim,
                "buckets": [{"exact_match": 0.5}]}

    monkeypatch.setattr(bottleneck, "run_one", fake_run_one)
    bottleneck.main(["--out", str(out)])
    assert made == list(bottleneck.RUNS)
    recorded = json.loads(out.read_text())
    assert recorded["command"] == "python -m attention_core.translation.bottleneck" and recorded["threads"] == 1
    made.clear()
    bottleneck.main(["--out", str(out)])
    assert made == [] and bottleneck.read_runs(out) == recorded["runs"]
