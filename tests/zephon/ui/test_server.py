"""``zephon ui`` over HTTP, served by a real process over a catalog filled by real runs:
what each page and its JSON say, that nothing writes (405 for every other method, the
database byte-identical after browsing everything), the loopback default and the token gate,
and the command's one-line errors."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sqlite3
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.zephon.ui.conftest import ZEPHON, start, stop

TOKEN = "s3cr3t-token-for-the-ui-tests"


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    """``(status, headers, body text)``; redirects are not followed."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


def api(served, path: str) -> dict:
    status, headers, body = get(f"{served.base}{path}")
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    return json.loads(body)


def test_the_runs_page_lists_each_run_with_state_latest_checkpoint_and_goodput(served):
    data = api(served, "/api/runs")
    assert (data["total"], data["page"], data["pages"]) == (2, 1, 1)
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"alpha", "beta"}
    alpha, beta = runs["alpha"], runs["beta"]
    assert alpha["status"] == "active" and alpha["latest_step"] == 8  # 10 is quarantined
    assert beta["latest_step"] == 6 and beta["committed"] == 2
    assert alpha["goodput"]["restarts"] >= 2 and 0 <= alpha["goodput"]["goodput"] < 1
    parts = ("productive_s", "lost_s", "overhead_s", "stall_s")
    assert sum(alpha["goodput"][p] for p in parts) == pytest.approx(alpha["goodput"]["wall_s"])
    status, _, html = get(f"{served.base}/runs")
    assert status == 200
    assert '<table id="runs">' in html and 'href="/runs/alpha"' in html
    assert "goodput" in html and "page 1 of 1" in html


def test_a_runs_page_is_a_shareable_url_with_its_filter_and_page(served):
    finished = api(served, "/api/runs?status=finished")
    assert (finished["total"], finished["runs"], finished["status"]) == (0, [], "finished")
    assert api(served, "/api/runs?page=2")["runs"] == []
    status, _, html = get(f"{served.base}/runs?status=active")
    assert status == 200 and 'class="on">active' in html


def test_a_run_page_shows_its_timeline_tiers_attempts_retention_and_damage(served):
    data = api(served, "/api/runs/alpha")
    steps = {c["step"]: c for c in data["checkpoints"]}
    assert sorted(steps) == [2, 4, 6, 7, 8, 10]
    # emergency save, with its own trigger
    assert data["emergency_steps"] == [7] and steps[7]["trigger"] == "emergency"
    # every save timed by phase; tiers and the upload lag of the local tier's saves
    assert all("total_s" in c["timings"] and "stall_s" in c["timings"] for c in steps.values())
    assert "write_s" in data["phases"]
    lagged = [c for c in steps.values() if c["upload_lag_s"] is not None]
    assert lagged and all(c["upload_lag_s"] >= 0 for c in lagged)
    assert {t["tier"] for c in lagged for t in c["tiers"]} >= {"local", "save_dir"}
    # attempts: the preempted first one, the restarts and the work they lost
    attempts = data["attempts"]
    assert attempts[0]["preempted"] and attempts[0]["restarted"]
    assert attempts[0]["reached_step"] == 7 and attempts[1]["resumed_from"] == 7
    assert [a["resumed_from"] for a in attempts][-1] == 8
    # the attempt that met the damaged step 10 had resumed from it; the next one from 8
    assert (attempts[-2]["resumed_from"], attempts[-2]["lost_steps"]) == (10, 2)
    assert attempts[1]["lost_steps"] == 0
    # retention: kept, pinned, deleted; damaged and quarantined
    assert data["retention"]["pinned"] == 1 and steps[4]["pinned"]
    assert data["retention"]["deleted"] == 2 and data["retention"]["committed"] == 3
    assert [(c["step"], c["state"]) for c in data["damaged"]] == [(10, "corrupt")]
    assert "CorruptCheckpointError: " in data["damaged"][0]["failure_reason"]
    assert data["goodput"]["run"] == "alpha"
    status, _, html = get(f"{served.base}/runs/alpha")
    assert status == 200
    for element in ('id="chart-timeline"', 'id="attempts"', 'id="retention"', 'id="damaged"'):
        assert element in html


def test_a_run_views_filters_are_in_its_url(served):
    only = api(served, "/api/runs/alpha?state=committed&state=corrupt")
    assert [c["step"] for c in only["checkpoints"]] == [4, 7, 8, 10]
    assert only["filter"]["states"] == ["committed", "corrupt"]
    created = {c["step"]: c["created_at"] for c in api(served, "/api/runs/alpha")["checkpoints"]}
    since = api(served, f"/api/runs/alpha?since={created[8].replace('+', '%2B')}")
    assert [c["step"] for c in since["checkpoints"]] == [8, 10]
    until = api(served, "/api/runs/alpha?until=2000-01-01T00:00:00Z")
    assert until["checkpoints"] == [] and until["attempts"]  # the rest of the page stays


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/runs/nobody", 404, "run 'nobody' is not in the catalog"),
        ("/api/runs?page=0", 400, "invalid page '0': use an integer from 1"),
        ("/api/runs?status=paused", 400, "invalid status 'paused': use one of active"),
        ("/runs/alpha?since=yesterday", 400, "invalid since 'yesterday': use an ISO 8601 time"),
        ("/runs/alpha?state=lost", 400, "invalid state 'lost'"),
        ("/runs/bad%20name", 400, "invalid run name"),
    ],
)
def test_bad_urls_get_one_line_naming_the_fix(served, path, status, message):
    got, _, body = get(f"{served.base}{path}")
    assert got == status
    assert body.startswith(f"zephon ui: {message}") and body.count("\n") == 1, body


ROUTES = ["/", "/runs", "/runs/alpha", "/api/runs", "/api/runs/alpha", "/static/ui.js", "/x"]


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_no_route_accepts_a_method_that_could_write(served, method):
    for path in ROUTES:
        status, headers, body = get(f"{served.base}{path}", method=method)
        assert (status, headers["allow"]) == (405, "GET, HEAD"), (path, body)


def test_browsing_every_view_leaves_the_database_byte_identical(served):
    def digest() -> str:
        with open(served.database, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()

    before = digest()
    with sqlite3.connect(f"file:{served.database}?mode=ro", uri=True) as db:
        counts = [db.execute(f"SELECT count(*) FROM {t}").fetchone() for t in ("events", "runs")]
    for path in [
        "/runs",
        "/api/runs",
        "/runs?status=active&page=1",
        "/runs/alpha",
        "/runs/beta",
        "/api/runs/alpha?state=corrupt",
        "/runs/nobody",
        "/static/ui.js",
    ]:
        get(f"{served.base}{path}")
    for method in ("POST", "DELETE"):
        get(f"{served.base}/runs/alpha", method=method)
    assert digest() == before
    with sqlite3.connect(f"file:{served.database}?mode=ro", uri=True) as db:
        after = [db.execute(f"SELECT count(*) FROM {t}").fetchone() for t in ("events", "runs")]
    assert after == counts


def test_pages_load_nothing_from_outside_the_server(served):
    for path in ("/runs", "/runs/alpha"):
        status, headers, html = get(f"{served.base}{path}")
        assert status == 200
        sources = re.findall(r'(?:src|href)="([^"]*)"', html)
        assert sources and all(s.startswith("/") for s in sources), sources
        policy = headers["content-security-policy"]
        assert "default-src 'self'" in policy and "unsafe-eval" not in policy
        # one script, the page's own refresh; the charts are SVG inside the page
        assert re.findall(r"<script[^>]*>", html) == ['<script src="/static/ui.js" defer>']
    status, _, html = get(f"{served.base}/runs/alpha")
    for chart in ("timeline", "phases", "tiers"):
        drawn = re.search(rf'<figure id="chart-{chart}"[^>]*>(.*?)</figure>', html, re.S)
        assert drawn and drawn.group(1).startswith("<svg") and 'class="series' in drawn.group(1)
    status, _, js = get(f"{served.base}/static/ui.js")
    assert status == 200 and len(js) < 5_000


def test_the_token_gate_of_a_remote_listener(filled):
    url, _ = filled
    process, base = start(
        ["--catalog", url, "--port", "0", "--host", "0.0.0.0", "--allow-remote"],
        env={"ZEPHON_UI_TOKEN": TOKEN},
    )
    try:
        port = base.rsplit(":", 1)[1]
        local = f"http://127.0.0.1:{port}"
        assert get(f"{local}/runs")[0] == 401
        assert (
            get(f"{local}/runs", {"authorization": "Bearer wrong-token-of-some-length"})[0] == 401
        )
        assert get(f"{local}/api/runs", {"authorization": f"Bearer {TOKEN}"})[0] == 200
        status, headers, _ = get(f"{local}/runs/alpha?state=corrupt&token={TOKEN}")
        assert status == 303
        assert headers["location"] == "/runs/alpha?state=corrupt"  # the token leaves the URL
        cookie = headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in headers["set-cookie"]
        assert get(f"{local}/runs/alpha", {"cookie": cookie})[0] == 200
        assert get(f"{local}/runs?token=wrong")[0] == 401
        assert get(f"{local}/runs", method="POST")[0] == 405
    finally:
        err = stop(process)
    assert TOKEN not in err


def run_zephon(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    import os

    done = subprocess.run(
        [*ZEPHON, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("argv", "env", "code", "message"),
    [
        (["--host", "0.0.0.0"], {}, 2, "--host 0.0.0.0 is not a loopback address"),
        (
            ["--host", "0.0.0.0", "--allow-remote"],
            {"ZEPHON_UI_TOKEN": ""},
            2,
            "--allow-remote needs a secret in the environment variable ZEPHON_UI_TOKEN",
        ),
        (
            ["--host", "0.0.0.0", "--allow-remote"],
            {"ZEPHON_UI_TOKEN": "short"},
            2,
            "(now too short)",
        ),
        (["--port", "70000"], {}, 2, "invalid number '70000'"),
    ],
)
def test_refused_addresses_are_one_line_errors(tmp_path, argv, env, code, message):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    got, out, err = run_zephon("ui", "--catalog", url, *argv, env=env)
    assert got == code, err
    assert message in err and err.count("\n") == 1 and err.startswith("zephon: error:"), err
    assert "short" not in err.replace("too short", "")  # a token is never echoed
    assert not (tmp_path / "c.db").exists()


def test_a_port_in_use_and_a_catalog_it_cannot_open_are_one_line_errors(tmp_path, filled):
    url, _ = filled
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        code, _, err = run_zephon("ui", "--catalog", url, "--port", port)
    assert code == 6 and f"port {port} on 127.0.0.1 is in use" in err and err.count("\n") == 1
    missing = tmp_path / "none.db"
    code, _, err = run_zephon("ui", "--catalog", f"sqlite:///{missing}", "--port", "0")
    assert code == 5 and "unable to open database file" in err and err.count("\n") == 1
    assert not missing.exists()
    code, _, err = run_zephon("ui", "--catalog", "mysql://u:hunter2@h/db", "--port", "0")
    assert code in (2, 5) and "expected sqlite:///PATH" in err and "hunter2" not in err


def test_the_start_line_names_the_address_and_masks_the_password(filled):
    url, _ = filled
    process, base = start(["--catalog", url, "--port", "0", "--refresh", "0"])
    try:
        assert base.startswith("http://127.0.0.1:")
        status, _, html = get(f"{base}/runs")
        assert status == 200 and 'data-refresh="0"' in html
        assert 'data-refresh="7"' in get(f"{base}/runs?refresh=7")[2]
    finally:
        stop(process)
