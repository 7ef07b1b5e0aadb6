"""The pytest plugin `python -m benchmarks llamatests` loads into llama.cpp's server tests: the model is the
local file LLAMATESTS_MODEL wherever a preset names a Hugging Face one (nothing is downloaded: the presets'
download step is skipped), and each test's outcome and the paths it asked for go to LLAMATESTS_OUT (JSON)."""
from __future__ import annotations

import json
import os

import utils  # the suite's own module: its folder is on sys.path (pytest's rootdir)

MODEL, OUT = os.environ["LLAMATESTS_MODEL"], os.environ["LLAMATESTS_OUT"]
results: dict[str, dict] = {}
utils.ServerPreset.load_all = staticmethod(lambda: None)
_start, _request, _stream = utils.ServerProcess.start, utils.ServerProcess.make_request, utils.ServerProcess.make_stream_request


def _asked(path: str) -> None:
    """The current test asked for `path` (each once: a start polls /health many times)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    paths = results.setdefault(test, {"paths": []})["paths"]
    if path not in paths:
        paths.append(path)


def start(self, *a, **k):
    self.model_hf_repo = self.model_hf_file = self.model_url = None
    self.model_file = MODEL
    return _start(self, *a, **k)


def make_request(self, method, path, *a, **k):
    _asked(f"{method} {path}")
    return _request(self, method, path, *a, **k)


def make_stream_request(self, method, path, *a, **k):
    _asked(f"{method} {path} (stream)")
    return _stream(self, method, path, *a, **k)


utils.ServerProcess.start, utils.ServerProcess.make_request = start, make_request
utils.ServerProcess.make_stream_request = make_stream_request


def pytest_runtest_logreport(report):
    entry = results.setdefault(report.nodeid, {"paths": []})
    if report.when == "call" or report.outcome != "passed":
        entry.setdefault("outcome", report.outcome)
        if report.outcome == "failed":
            entry["why"] = (report.longreprtext or "").strip().splitlines()[-1:][0][:300] if report.longreprtext else ""


def pytest_sessionfinish(session):
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1)
