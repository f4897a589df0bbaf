"""The CLI: submit -> status -> logs -> cancel, output formats, namespaces, exit codes, no secrets."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobspec.contract import ANNOTATION_SPEC_HASH, EXIT_CLUSTER, EXIT_CONFIG, EXIT_OK

from .conftest import BARE_SPEC, NAMED_SPEC, CliRun
from .fake_api import TOKEN, FakeApi

REPO = Path(__file__).resolve().parents[2]


def test_happy_path_submit_status_logs_cancel(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    kc = ["--kubeconfig", str(kubeconfig)]
    code, out, _ = cli("submit", BARE_SPEC, *kc)
    assert code == EXIT_OK
    assert 'job "quickstart" in namespace "ml" created' in out
    assert f"jobspec logs quickstart -n ml --kubeconfig {kubeconfig} -f" in out
    assert [k[0] for k in api.objects] == ["configmaps", "services", "networkpolicies", "jobs"]

    code, out, _ = cli("submit", BARE_SPEC, *kc)
    assert code == EXIT_OK and "already submitted with this spec (Pending); nothing changed" in out

    api.get("jobs", "ml", "quickstart")["status"] = {"active": 1}
    pod = api.add_pod("ml", "quickstart", 0)["metadata"]["name"]
    code, out, _ = cli("status", "quickstart", *kc)
    assert code == EXIT_OK and "phase      Running" in out and pod in out

    api.logs[("ml", pod)] = b"step 10 loss 3.1\n"
    assert cli("logs", "quickstart", *kc)[:2] == (EXIT_OK, "step 10 loss 3.1\n")

    api.streams[("ml", pod)] = [
        [
            b"2025-01-01T00:00:01Z step 20\n",
            lambda: api.set_pod("ml", pod, "Succeeded", {"terminated": {"exitCode": 0}}),
        ]
    ]
    assert cli("logs", "quickstart", "-f", *kc)[:2] == (EXIT_OK, "step 20\n")

    code, out, _ = cli("cancel", "quickstart", *kc)
    assert code == EXIT_OK and "job.batch/quickstart deleted" in out and 'job "quickstart" cancelled' in out
    assert api.objects == {}
    assert cli("list", *kc)[:2] == (EXIT_OK, "no jobs made by jobspec found\n")


def test_client_dry_run_needs_no_cluster(api: FakeApi, cli: CliRun) -> None:
    for argv in (
        ["submit", BARE_SPEC, "--dry-run"],
        ["submit", "--dry-run", BARE_SPEC],
        ["submit", "--dry-run=client", BARE_SPEC],
    ):
        code, out, _ = cli(*argv)
        assert code == EXIT_OK
        docs = list(yaml.safe_load_all(out))
        assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "NetworkPolicy", "Job"]
        assert {d["metadata"]["namespace"] for d in docs} == {"default"}  # no kubeconfig: "default"
    assert api.requests == []


def test_server_dry_run_asks_the_server(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    code, out, _ = cli("submit", BARE_SPEC, "--dry-run=server", "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK
    assert "job.batch/quickstart created (server dry run)" in out and "nothing was persisted" in out
    assert [p.query.get("dryRun") for p in api.calls("PATCH")] == ["All"] * 4
    assert api.objects == {}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([BARE_SPEC], "ml"),  # the context's namespace
        ([BARE_SPEC, "--context", "other"], "other-ns"),
        ([BARE_SPEC, "-n", "flag-ns"], "flag-ns"),
        ([NAMED_SPEC], "spec-ns"),  # the spec's
        ([NAMED_SPEC, "--context", "other"], "spec-ns"),  # the spec beats the context
        ([NAMED_SPEC, "--set", "namespace=set-ns"], "set-ns"),
        ([NAMED_SPEC, "--namespace", "flag-ns", "--context", "other"], "flag-ns"),  # the flag beats all
    ],
)
def test_namespace_precedence(api: FakeApi, kubeconfig: Path, cli: CliRun, argv: list[str], expected: str) -> None:
    code, _, err = cli("submit", *argv, "--kubeconfig", str(kubeconfig))
    assert code == EXIT_OK, err
    assert {k[1] for k in api.objects} == {expected}


def test_namespace_defaults_to_default(api: FakeApi, tmp_path: Path, cli: CliRun) -> None:
    kc = api.kubeconfig(tmp_path, namespace=None)
    assert cli("submit", BARE_SPEC, "--kubeconfig", str(kc))[0] == EXIT_OK
    assert {k[1] for k in api.objects} == {"default"}


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["status", "ghost"], EXIT_CLUSTER, 'error: job "ghost" does not exist in namespace "ml"'),
        (["cancel", "ghost"], EXIT_CLUSTER, 'job "ghost" does not exist in namespace "ml"'),
        (["status", "Bad_Name"], EXIT_CONFIG, "not a valid job name"),
        (["status", "x", "-n", "Bad_NS"], EXIT_CONFIG, "not a valid Kubernetes namespace"),
        (["logs", "x", "-f", "--previous"], EXIT_CONFIG, "cannot be combined"),
        (["submit", "--dry-run=maybe", BARE_SPEC], EXIT_CONFIG, "expected client or server"),
        (["submit"], EXIT_CONFIG, "submit needs a SPEC"),
        (["submit", "missing.yaml"], EXIT_CONFIG, "missing.yaml"),
        (["status", "x", "--context", "nope"], EXIT_CONFIG, "nope"),
    ],
)
def test_exit_codes(kubeconfig: Path, cli: CliRun, argv: list[str], code: int, message: str) -> None:
    got, _, err = cli(*argv, "--kubeconfig", str(kubeconfig))
    assert got == code and message in err


def test_no_kubeconfig_is_bad_input(cli: CliRun) -> None:
    code, _, err = cli("status", "x")
    assert code == EXIT_CONFIG and "no Kubernetes configuration found" in err


def test_refused_submit_exits_3_naming_the_rbac_gap(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    api.fail(
        "PATCH",
        r"/configmaps/",
        403,
        message=(
            'configmaps "quickstart-spec" is forbidden: User "alice" cannot patch resource "configmaps" '
            'in API group "" in the namespace "ml"'
        ),
    )
    code, _, err = cli("submit", BARE_SPEC, "--kubeconfig", str(kubeconfig))
    assert code == EXIT_CLUSTER
    assert 'RBAC refused: cannot patch configmaps "quickstart-spec" in namespace "ml"' in err


def test_changed_spec_is_refused_then_replaced(api: FakeApi, kubeconfig: Path, cli: CliRun) -> None:
    kc = ["--kubeconfig", str(kubeconfig)]
    assert cli("submit", BARE_SPEC, *kc)[0] == EXIT_OK
    old = api.get("jobs", "ml", "quickstart")["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    code, _, err = cli("submit", BARE_SPEC, "--set", "training.steps=1234", *kc)
    assert code == EXIT_CLUSTER and "with a different spec" in err and "--replace" in err
    code, out, _ = cli("submit", BARE_SPEC, "--set", "training.steps=1234", "--replace", *kc)
    assert code == EXIT_OK and "replaced (old job deleted first)" in out
    assert api.get("jobs", "ml", "quickstart")["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != old


def test_no_credentials_in_any_output(
    api: FakeApi, kubeconfig: Path, cli: CliRun, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kc = ["--kubeconfig", str(kubeconfig), "--debug"]
    seen = []
    seen.append(cli("submit", BARE_SPEC, *kc))
    seen.append(cli("status", "quickstart", "-o", "json", *kc))
    api.fail("GET", r"/jobs/quickstart$", 503, times=2, headers={"Retry-After": "0"})
    seen.append(cli("status", "quickstart", *kc))
    api.fail("GET", r"/jobs/quickstart$", 401)
    seen.append(cli("status", "quickstart", *kc))
    api.fail("DELETE", r"/jobs/quickstart$", 403, message="forbidden")
    seen.append(cli("cancel", "quickstart", *kc))
    api.fail("GET", r"/jobs/", reset=True, times=10)
    seen.append(cli("status", "quickstart", *kc))
    assert [s[0] for s in seen] == [EXIT_OK, EXIT_OK, EXIT_OK, EXIT_CLUSTER, EXIT_CLUSTER, EXIT_CLUSTER]
    text = caplog.text + "".join(out + err for _, out, err in seen)
    assert "bearer token (redacted)" in caplog.text  # --debug says which auth, never its value
    assert TOKEN not in text and TOKEN[4:12] not in text


def test_help_documents_exit_codes(cli: CliRun, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli("status", "--help")
    out = capsys.readouterr().out
    assert "exit codes:" in out and "1  the job failed" in out and "3  cluster or API error" in out
    assert "--request-timeout" in out and "--context" in out and "--kubeconfig" in out


def test_request_timeout_parsing(cli: CliRun, capsys: pytest.CaptureFixture[str]) -> None:
    from jobspec.cluster.cli import _seconds

    assert (_seconds("30"), _seconds("2m"), _seconds("500ms"), _seconds("1.5s")) == (30.0, 120.0, 0.5, 1.5)
    with pytest.raises(SystemExit):
        cli("status", "x", "--request-timeout", "0")
    assert "expected a duration" in capsys.readouterr().err


def test_cluster_commands_stay_light(tmp_path: Path) -> None:
    """Registering the commands imports no kubernetes client; a client dry run imports neither it nor torch."""
    code = (
        "import sys\n"
        "from jobspec.cluster.cli import add_cluster_commands\n"
        "assert 'kubernetes' not in sys.modules, 'kubernetes imported by the CLI hook'\n"
        "from jobspec.cli import main\n"
        f"rc = main(['submit', '--dry-run', {str(REPO / 'examples' / 'quickstart.yaml')!r}])\n"
        "heavy = sorted(m for m in ('kubernetes', 'torch', 'urllib3', 'tenacity') if m in sys.modules)\n"
        "assert rc == 0 and not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "kind: Job" in done.stdout
