"""Secrets in every shape, in every field that is rendered: refused at load (exit 2) with a pointer to the
`{secret, key}` reference (a secretKeyRef), the secret itself never printed, not even in part.

Shapes from issue 22: names run together or in mixed case (HFTOKEN, hfToken, SSH_PRIVATE), URLs with only
a user or only a password (`redis://:pw@h`), secret query parameters (`?token=`, `&sig=`), webhook URLs,
and the same in tracking URIs and data paths; and more of each class.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobspec.errors import SpecError
from jobspec.render import render
from jobspec.spec.credentials import credential_kind, is_secret_name, redact
from jobspec.spec.loader import load_spec, parse_spec
from tests.cli_helpers import ROOT, cli
from tests.spec_fields import dotted, leaves, spec_with, to_yaml

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SECRET = "Zq8wX3rT6yU9iO2pL5"  # the part of each value that must never be printed
PIECE = 6  # no 6 characters of it in a row


def leaked(text: str, secret: str = SECRET) -> list[str]:
    return [secret[i : i + PIECE] for i in range(len(secret) - PIECE + 1) if secret[i : i + PIECE] in text]


# --- names -----------------------------------------------------------------------------------

SECRET_NAMES = [
    "HFTOKEN", "HF_TOKEN", "hfToken", "HfToken", "HFToken", "hf_token", "SSH_PRIVATE", "DB_DSN", "SENTRYDSN",
    "MY_CREDENTIALS", "creds", "APIKEY", "apiKey", "X_API_KEY", "PASSWD", "DBPASS", "MYSQL_PWD", "PGPASSWORD",
    "clientSecret", "CLIENT_SECRET2", "GITHUB_PAT", "AUTH", "BASIC_AUTH", "AWS_SESSION_TOKEN", "NPM_AUTH_TOKEN",
    "SLACK_WEBHOOK", "DISCORD_WEBHOOK_URL", "SSHKEY", "SIGNING_KEY", "ENCRYPTION_KEY", "SESSION_ID", "COOKIES",
    "PASSPHRASE", "GPG_PASSPHRASE", "OAUTH_TOKEN", "authToken", "REFRESH_TOKEN", "JWT", "MY_SECRETS",
]  # fmt: skip
PLAIN_NAMES = [
    "TOKENIZERS_PARALLELISM", "TOKENIZER_NAME", "tokenizer", "KEYBOARD", "MONKEY", "MAX_TOKENS", "max_tokens",
    "maxTokens", "MAX_NEW_TOKENS", "PAD_TOKEN", "padToken", "EOS_TOKEN_ID", "PWD", "OLDPWD", "XAUTHORITY",
    "BYPASS", "PASS_THROUGH", "NUM_PASSES", "AUTH_TYPE", "SORT_KEY", "PUBLIC_KEY", "PROMPT_KEY", "KEY_PATH",
    "HF_TOKEN_PATH", "DB_PASSWORD_FILE", "SSH_KEY_FILE", "SECRET_NAME", "HF_HUB_ENABLE_HF_TRANSFER", "PRIVATE_REGISTRY",
    "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "WANDB_PROJECT", "TOKEN_TYPE",
]  # fmt: skip


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_names_that_mark_a_secret_in_any_spelling(name: str) -> None:
    assert is_secret_name(name)
    with pytest.raises(SpecError) as info:
        parse_spec(to_yaml(spec_with(("env", name), SECRET)))
    text = str(info.value)
    assert f"env.{name}" in text and "inline secret" in text and "secretKeyRef" in text, text
    assert not leaked(text)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_names_that_only_look_like_one_stay_accepted(name: str) -> None:
    assert not is_secret_name(name)
    assert parse_spec(to_yaml(spec_with(("env", name), "some-setting"))).env[name] == "some-setting"


def test_a_secret_name_takes_a_reference() -> None:
    ref = {"secret": "hf", "key": "token"}
    spec = parse_spec(to_yaml(spec_with(("env", "HFTOKEN"), ref)))
    env = render(spec)[-1]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HFTOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    alias = parse_spec(to_yaml(spec_with(("env", "HUGGING_FACE_HUB_TOKEN"), "$(HF_TOKEN)")))  # Kubernetes fills it
    assert alias.env["HUGGING_FACE_HUB_TOKEN"] == "$(HF_TOKEN)"


@pytest.mark.parametrize("part", ["key", "secret"])
def test_a_reference_that_holds_a_token_is_refused(part: str) -> None:
    ref = {"secret": "hf", "key": "token", part: "sk-" + SECRET.lower() + "abcdefgh"}
    with pytest.raises(SpecError) as info:
        parse_spec(to_yaml(spec_with(("env", "HF_TOKEN"), ref)))
    assert "env.HF_TOKEN" in str(info.value) and not leaked(str(info.value), SECRET.lower()), str(info.value)


# --- values ----------------------------------------------------------------------------------

SHAPES = {
    "url user and password": f"postgres://app:{SECRET}@db.internal:5432/x",
    "url password only": f"redis://:{SECRET}@cache:6379/0",
    "url user only": f"https://{SECRET}@github.com/org/data.git",
    "url user only, git+https": f"git+https://{SECRET}@gitlab.com/org/repo",
    "bare user and password": f"robot:{SECRET}@registry.example.com/team/x",
    "query token": f"https://data.example.com/train.jsonl?token={SECRET}",
    "query access_token": f"https://data.example.com/x?format=jsonl&access_token={SECRET}",
    "query sig (Azure SAS)": f"https://acct.blob.core.windows.net/c/train.jsonl?sv=2022-11-02&se=2030-01-01&sig={SECRET}",
    "query X-Amz-Signature": f"https://b.s3.amazonaws.com/t.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}",
    "query X-Amz-Security-Token": f"https://b.s3.amazonaws.com/t.jsonl?X-Amz-Security-Token={SECRET}",
    "query api_key": f"https://mlflow.example.com/?api_key={SECRET}",
    "query apikey": f"https://mlflow.example.com/?apikey={SECRET}",
    "query key": f"https://chat.googleapis.com/v1/spaces/AAA/messages?key={SECRET}",
    "query password": f"https://h.example.com/?user=me&password={SECRET}",
    "fragment access_token": f"https://h.example.com/cb#access_token={SECRET}",
    "slack webhook": f"https://hooks.slack.com/services/T0123ABCD/B0123ABCD/{SECRET}",
    "slack webhook without scheme": f"hooks.slack.com/services/T0123ABCD/B0123ABCD/{SECRET}",
    "discord webhook": f"https://discord.com/api/webhooks/123456789012345678/{SECRET}",
    "teams webhook": f"https://acme.webhook.office.com/webhookb2/{SECRET}",
    "mattermost webhook": f"https://chat.example.com/hooks/{SECRET}",
    "generic webhook": f"https://ci.example.com/api/webhook/{SECRET}",
    "ifttt key in path": f"https://maker.ifttt.com/trigger/done/with/key/{SECRET}",
    "opaque path segment": "https://mlflow.example.com/t/a8Kd93Jf0Qm2Xz7Lp4Rt9Vw1/runs",
    "connection string": f"Server=db;User Id=app;Password={SECRET};",
    "flag": f"--hf-token={SECRET}",
    "json": f'{{"api_key": "{SECRET}"}}',
    "hugging face": "hf_" + SECRET + "abcdefghijklmnop",
    "github": "ghp_" + SECRET + "abcdefghijklmnopqr",
    "github fine-grained": "github_pat_" + SECRET + "_abcdefghij",
    "openai": "sk-proj-" + SECRET + "abcdefgh",
    "anthropic": "sk-ant-api03-" + SECRET + "abcdefgh",
    "slack token": "xoxb-123456789012-" + SECRET,
    "aws access key": "AKIA" + SECRET[:16].upper(),
    "gitlab": "glpat-" + SECRET + "abcd",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0." + SECRET,
    "bearer": "Bearer " + SECRET,
    "telegram bot": "123456789:" + SECRET + "abcdefghijklmnopq",
}  # fmt: skip
# Where each lands in the manifest: the ConfigMap carries the whole spec; these also land in the pod.
FIELDS = [
    ("env", "MY_SETTING"), ("tracking", "mlflow", "tracking_uri"), ("data", "path"), ("data", "eval_path"),
    ("model", "path"), ("image", "name"), ("checkpoints", "dir"), ("output", "dir"), ("tracking", "run_name"),
    ("tracking", "tensorboard", "logdir"), ("tracking", "wandb", "entity"), ("scheduling", "annotations", "note"),
]  # fmt: skip


def _secret_part(shape: str) -> str:
    value = SHAPES[shape]
    return "a8Kd93Jf0Qm2Xz7Lp4Rt9Vw1" if shape == "opaque path segment" else SECRET if SECRET in value else value


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_is_a_credential_and_redacted(shape: str) -> None:
    value, secret = SHAPES[shape], _secret_part(shape)
    assert credential_kind(value), shape
    assert not leaked(redact(value), secret), redact(value)


@pytest.mark.parametrize("field", FIELDS, ids=dotted)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_in_every_rendered_field_is_refused_unprinted(shape: str, field: tuple[str, ...]) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(to_yaml(spec_with(field, SHAPES[shape])))
    text = str(info.value)
    assert info.value.exit_code == 2
    assert any(
        i.path == dotted(field) and ("credential" in i.message or "secret" in i.message) for i in info.value.issues
    ), text
    assert "secretKeyRef" in text or "{secret" in text, text
    assert not leaked(text, _secret_part(shape)), text


@pytest.mark.parametrize(("loc", "kind"), [(loc, k) for loc, k in leaves() if k in ("str", "key")], ids=lambda x: x)
def test_no_text_field_or_key_carries_a_credential(loc: tuple, kind: str) -> None:
    """Every text field of the models and every map key, walked: a token or a URL password is refused."""
    for value in ("hf_" + SECRET + "abcdefghijklmnop", f"https://u:{SECRET}@h.example.com/x", f"https://{SECRET}@h/x"):
        with pytest.raises(SpecError) as info:
            parse_spec(to_yaml(spec_with(loc, value, kind)))
        assert not leaked(str(info.value)), str(info.value)


@pytest.mark.parametrize("command", ["validate", "render"])
@pytest.mark.parametrize(
    "shape", ["url password only", "url user only", "query token", "query sig (Azure SAS)", "slack webhook"]
)
def test_the_commands_refuse_without_printing(command: str, shape: str, tmp_path: Path) -> None:
    for field in (("env", "NOTES"), ("tracking", "mlflow", "tracking_uri"), ("data", "path")):
        spec = tmp_path / "spec.yaml"
        spec.write_text(to_yaml(spec_with(field, SHAPES[shape])))
        code, out = cli(command, str(spec))
        assert code == 2 and dotted(field) in out and not leaked(out), out
        code, out = cli(command, str(QUICKSTART), "--set", f"{dotted(field)}={SHAPES[shape]}")
        assert code == 2 and not leaked(out), out


ORDINARY = {
    ("model", "path"): ["meta-llama/Meta-Llama-3-8B-Instruct", "/models/Qwen2.5-0.5B", "hf://org/model@main"],
    ("data", "path"): [
        "s3://bucket/train.jsonl", "s3://bucket/data/train-00000-of-00001.parquet",
        "s3://bucket/sets/date=2024-01-01/owner@team/train.jsonl", "s3://bucket/datasets/org--name/v1/",
        "/data/0123456789abcdef0123456789abcdef01234567/train.jsonl", "org/name",
    ],  # other URLs (gs://, https://, hf://) are refused as data sources (tests/runner/process/test_remote_data.py)
    ("tracking", "mlflow", "tracking_uri"): ["https://mlflow.internal:5000", "file:///runs/mlruns", "databricks"],
    ("env", "HF_HUB_TOKEN_FROM"): ["$(HF_TOKEN)"],
    ("env", "ARGS"): ["--hf-token=$(HF_TOKEN) --max_tokens=512 --auth=none", "--token=${HF_TOKEN}"],
    ("env", "GIT_REMOTE"): ["ssh://git@github.com/org/repo.git", "git@github.com:org/repo.git"],
    ("env", "OWNER"): ["alice@example.com", "https://docs.example.com/page?lang=en&page=2"],
    ("scheduling", "annotations", "vault.hashicorp.com/agent-inject-secret-db"): ["database/creds/app"],
    ("image", "name"): ["ghcr.io/org/trainer:1.0@sha256:" + "ab" * 32, "trainer:22.04@sha256:" + "cd" * 32],
}  # fmt: skip


@pytest.mark.parametrize("field", sorted(ORDINARY), ids=dotted)
def test_ordinary_values_stay_accepted(field: tuple[str, ...]) -> None:
    for value in ORDINARY[field]:
        data = spec_with(field, value)
        if field[0] == "image":
            data["hardware"] = {"vendor": "cuda"}
        spec = parse_spec(to_yaml(data))
        assert value in to_yaml(spec.to_yaml_dict()).replace("'", "") or value in str(spec.model_dump()), value


def test_every_example_renders_no_credential_shape() -> None:
    """The shipped examples are credential-free all the way to the manifest (the scan never cries wolf on them)."""
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for obj in render(load_spec(path)):
            todo: list[object] = [obj]
            while todo:
                value = todo.pop()
                if isinstance(value, dict):
                    todo += [*value.keys(), *value.values()]
                elif isinstance(value, list):
                    todo += value
                elif isinstance(value, str):
                    assert not credential_kind(value), (path.name, value[:80])
