"""Property-based fuzzing of the server's OpenAPI schema with schemathesis: no input gives a 5xx."""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis", reason="pip install schemathesis")

from test_server_support import API_KEY, artifact, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--ctx", "128")     # a small context keeps every generation short
    yield srv
    srv.stop()


def test_schemathesis_finds_no_server_errors(server, tmp_path):
    report = tmp_path / "schemathesis-junit.xml"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}", "--checks", "not_a_server_error", "--max-examples", "10",
           "--seed", "1", "--generation-database", "none", "--workers", "1", "--request-timeout", "30",
           "--no-color", "--report", "junit", "--report-junit-path", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    artifact(report)
    cases = ET.parse(report).getroot().iter("testcase")
    tested, server_errors = 0, []
    for case in cases:
        tested += 1
        for failure in case.findall("failure"):
            if "Server error" in (failure.text or "") or failure.get("message") == "ST101":
                server_errors.append(f"{case.get('name')}: {(failure.text or '')[:1500]}")
    assert tested >= 6, run.stdout[-3000:]
    assert not server_errors, "\n\n".join(server_errors)
    assert "Server error" not in run.stdout, run.stdout[-5000:]
