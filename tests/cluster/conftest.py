"""Fixtures: a fake API server, a kubeconfig pointing at it, a client that never really sleeps."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from jobspec.cluster.cli import add_cluster_commands
from jobspec.cluster.client import ClusterClient
from jobspec.cluster.kubeconfig import load_connection
from jobspec.cluster.retry import RetryPolicy
from jobspec.errors import JobspecError

from .fake_api import FakeApi

REPO = Path(__file__).resolve().parents[2]
# Placeholders the `cli` fixture swaps for spec files made from examples/quickstart.yaml:
# job "quickstart", without a namespace / with `namespace: spec-ns`.
BARE_SPEC, NAMED_SPEC = "<bare-spec>", "<named-spec>"


@pytest.fixture(autouse=True)
def _isolated_env(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No real kubeconfig or service account may leak into these tests, except into the `cluster` tier
    (test_real_cluster.py), whose whole point is the cluster KUBECONFIG names."""
    if request.node.get_closest_marker("cluster") is not None:
        return
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi().start()
    yield fake
    fake.stop()


@pytest.fixture
def kubeconfig(api: FakeApi, tmp_path: Path) -> Path:
    return api.kubeconfig(tmp_path)


@pytest.fixture
def sleeps() -> list[float]:
    """Every wait the code asked for, in seconds (nothing really sleeps)."""
    return []


@pytest.fixture
def policy(sleeps: list[float]) -> RetryPolicy:
    return RetryPolicy(attempts=4, sleep=sleeps.append)


@pytest.fixture
def client(kubeconfig: Path, policy: RetryPolicy) -> Iterator[ClusterClient]:
    with ClusterClient(load_connection(str(kubeconfig)), timeout=2.0, policy=policy, follow_idle=2.0) as c:
        yield c


CliRun = Callable[..., tuple[int, str, str]]


@pytest.fixture
def spec_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    data.pop("namespace", None)
    data["name"] = "quickstart"
    folder = tmp_path_factory.mktemp("specs")
    (folder / "bare.yaml").write_text(yaml.safe_dump(data))
    (folder / "named.yaml").write_text(yaml.safe_dump({**data, "namespace": "spec-ns"}))
    return {BARE_SPEC: str(folder / "bare.yaml"), NAMED_SPEC: str(folder / "named.yaml")}


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], policy: RetryPolicy, spec_files: dict[str, str]) -> CliRun:
    """Run `jobspec <argv>` the way jobspec.cli.main does: exit code, stdout, stderr."""

    def run(*argv: str) -> tuple[int, str, str]:
        argv = tuple(spec_files.get(a, a) for a in argv)
        common = argparse.ArgumentParser(add_help=False)
        common.add_argument("--debug", action="store_true")
        parser = argparse.ArgumentParser(prog="jobspec")
        add_cluster_commands(parser.add_subparsers(dest="command"), common)
        capsys.readouterr()
        args = parser.parse_args(argv)
        if args.debug:
            logging.getLogger().setLevel(logging.DEBUG)
        args.retry_policy = policy
        try:
            code = args.func(args)
        except JobspecError as err:
            print(f"error: {err}", file=__import__("sys").stderr)
            code = err.exit_code
        out, err = capsys.readouterr()
        return code, out, err

    return run
