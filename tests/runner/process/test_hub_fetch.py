"""A hub model fetched once per node by the supervisor (runner/process/hub.py), against a fake hub on
127.0.0.1 serving a tiny model from files (HF_ENDPOINT): one download of each file for a two-rank run,
none on a restart, the cache used when the hub is down, and each failure with its exit code and no token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from tests.runner.train_helpers import ROOT, run_supervisor, runner_env, save_test_tokenizer, tiny_spec_dict, write_spec

from .fake_hub import FakeHub

REPO = "org/tiny-gpt2"
GATED = "org/gated"
GOOD_TOKEN = "hf_" + "Zq9Xw" * 7  # the gated repository's
WRONG_TOKEN = "hf_" + "Kp3Lm" * 7
# What training reads; the repository also holds what it must not fetch.
WANTED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}
DECOYS = {"pytorch_model.bin", "README.md", "onnx/model.onnx"}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("repo")
    save_test_tokenizer(path)
    config = GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    (path / "pytorch_model.bin").write_bytes(b"not read: safetensors win")
    (path / "README.md").write_text("# tiny\n")
    (path / "onnx").mkdir()
    (path / "onnx" / "model.onnx").write_bytes(b"not read")
    assert {p.name for p in path.iterdir()} >= WANTED
    return path


@pytest.fixture
def hub(repo_dir: Path):
    fake = FakeHub({REPO: repo_dir, GATED: repo_dir}, gated={GATED: GOOD_TOKEN}).start()
    yield fake
    fake.stop()


def hub_spec(tmp_path: Path, path: str = REPO, **model: str) -> Path:
    spec = tiny_spec_dict(tmp_path / "run", training={"steps": 2, "warmup_steps": 0, "global_batch": 4, "log_every": 1},
                          hardware={"vendor": "cpu", "gpus": 2})  # fmt: skip
    spec["model"] = {"path": path, **model}
    spec["checkpoints"]["every_steps"] = 2
    spec["output"] = {"export": False}
    return write_spec(tmp_path / "spec.yaml", spec)


def hub_env(hub_url: str, home: Path, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub_url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": "", **extra}


@pytest.mark.slow
def test_two_ranks_download_each_file_once_and_a_restart_none(tmp_path: Path, hub: FakeHub) -> None:
    spec = hub_spec(tmp_path)
    env = hub_env(hub.url, tmp_path / "hf")
    done = run_supervisor([str(spec)], **env)
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    assert "starting 2 worker(s)" in done.stderr
    assert dict(hub.file_gets()) == dict.fromkeys(WANTED, 1)  # two ranks, one download each, no decoy
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny-gpt2" / "snapshots" / hub.commit(REPO)
    assert {p.name for p in snapshot.iterdir()} == WANTED
    assert str(snapshot) in done.stderr  # the workers were handed the local snapshot

    hub.requests.clear()
    again = run_supervisor([str(spec)], **env)  # a restart (here: of a finished run) with the hub up
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    assert hub.file_gets() == {}  # no file requested: the cache holds the commit the hub names

    hub.stop()  # the hub out of reach: the cached snapshot serves
    offline = run_supervisor([str(spec)], **env)
    assert offline.returncode == EXIT_OK, offline.stderr[-3000:]
    assert "using the cached snapshot" in offline.stderr


def test_a_missing_repository_is_a_config_error(tmp_path: Path, hub: FakeHub) -> None:
    done = run_supervisor([str(hub_spec(tmp_path, "org/no-such-model"))], **hub_env(hub.url, tmp_path / "hf"))
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    assert "model.path 'org/no-such-model' (revision main): no such model on the hub" in done.stderr
    assert "Traceback" not in done.stderr and hub.file_gets() == {}


def test_a_missing_revision_is_a_config_error(tmp_path: Path, hub: FakeHub) -> None:
    done = run_supervisor([str(hub_spec(tmp_path, revision="v9"))], **hub_env(hub.url, tmp_path / "hf"))
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    assert "no such revision" in done.stderr and "model.revision" in done.stderr


@pytest.mark.parametrize("token", ["", WRONG_TOKEN])
def test_a_gated_repository_without_access_is_a_config_error_and_the_token_is_never_shown(
    tmp_path: Path, hub: FakeHub, token: str
) -> None:
    done = run_supervisor([str(hub_spec(tmp_path, GATED))], **hub_env(hub.url, tmp_path / "hf", HF_TOKEN=token))
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    assert "model.hub_token" in done.stderr and "Traceback" not in done.stderr
    assert WRONG_TOKEN not in done.stdout + done.stderr


def test_a_gated_repository_with_its_token_downloads(tmp_path: Path, hub: FakeHub) -> None:
    # In a process of its own: huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported.
    code = (
        "import sys; from jobspec.spec.loader import load_spec; from runner.process.supervisor import with_hub_model;"
        "spec, overrides = with_hub_model(sys.argv[1], load_spec(sys.argv[1]), []); print(spec.model.path, overrides)"
    )
    env = runner_env(**hub_env(hub.url, tmp_path / "hf", HF_TOKEN=GOOD_TOKEN))
    done = subprocess.run([sys.executable, "-c", code, str(hub_spec(tmp_path, GATED))], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    path, overrides = done.stdout.split(" ", 1)
    assert Path(path, "model.safetensors").is_file() and overrides.strip() == f"['model.path=\"{path}\"']"
    assert dict(hub.file_gets()) == dict.fromkeys(WANTED, 1)
    assert GOOD_TOKEN not in done.stdout + done.stderr


def test_an_unreachable_hub_with_nothing_cached_is_retried(tmp_path: Path, hub: FakeHub) -> None:
    url = hub.url
    hub.stop()
    done = run_supervisor([str(hub_spec(tmp_path))], **hub_env(url, tmp_path / "hf"))
    assert done.returncode == EXIT_FAILED, done.stderr[-3000:]  # not FailJob: the Job's next pod tries again
    assert "the hub cannot be reached" in done.stderr and "not in the cache" in done.stderr
    assert "Traceback" not in done.stderr
