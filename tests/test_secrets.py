"""Credentials never echo: not from the spec, not from --set, not from argparse, not from the API.

The property test generates token-looking values for secret-like names, passes them in every
way a user could (by mistake), and checks that no 6-character piece of the value reaches
stdout or stderr, and that the exit code is 2.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jobspec.cluster.errors import Op, error_for_status, server_message
from jobspec.cluster.status import parse_report
from jobspec.errors import SpecError
from jobspec.spec.credentials import credential_kind, is_secret_name, redact
from jobspec.spec.loader import parse_spec
from tests.cli_helpers import cli
from tests.cpu_clock import cpu_seconds

GOOD = "name: demo\nmodel:\n  preset: tiny\ntraining:\n  global_batch: 8\n  steps: 10\nhardware:\n  vendor: cpu\n"


def pieces(value: str, n: int = 6) -> set[str]:
    return {value[i : i + n] for i in range(len(value) - n + 1)}


# --- names -----------------------------------------------------------------------------------

SECRET_NAMES = [
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "WANDB_KEY", "OPENAI_KEY", "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "DB_PASSWORD", "DB_PASS", "DB_PWD",
    "PGPASSWORD_X_PASSWD", "BASIC_AUTH", "HTTP_AUTHORIZATION", "BEARER", "SENTRY_DSN", "DATABASE_URL",
    "AZURE_STORAGE_CONNECTION_STRING", "SESSION", "SESSION_ID", "COOKIE", "SLACK_WEBHOOK_URL", "GH_TOKEN2",
    "GOOGLE_APPLICATION_CREDENTIALS", "PRIVATE_KEY", "MLFLOW_TRACKING_TOKEN", "hf_token",
    "HFTOKEN", "hfToken", "SSH_PRIVATE", "DB_DSN", "MY_CREDENTIALS", "APIKEY", "PASSWD", "GITHUB_PAT",
]  # fmt: skip
CONFIG_NAMES = [
    "TOKENIZERS_PARALLELISM", "KEYBOARD", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME", "PWD", "MAX_TOKENS", "PAD_TOKEN", "EOS_TOKEN_ID", "AUTH_TYPE", "PASS_THROUGH", "SORT_KEY",
    "PUBLIC_KEY", "KEY_PATH", "HF_HOME", "WANDB_MODE", "WANDB_PROJECT", "OMP_NUM_THREADS", "NUM_PASSES", "MONKEY",
    "max_tokens", "padToken", "HF_TOKEN_PATH", "DB_PASSWORD_FILE", "OLDPWD", "XAUTHORITY", "TOKENIZER_NAME",
]  # fmt: skip


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_like_names_are_refused_inline(name: str) -> None:
    assert is_secret_name(name)
    with pytest.raises(SpecError, match="inline secret"):
        parse_spec(GOOD, overrides=[f"env.{name}=x"])


def test_ordinary_config_stays_accepted() -> None:
    values = {
        "TOKENIZERS_PARALLELISM": "false",
        "KEYBOARD": "us",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "PWD": "/workspace",
        "PAD_TOKEN": "<pad>",
        "MAX_TOKENS": "512",
        "MODEL_REVISION": "0123456789abcdef0123456789abcdef01234567",  # a git commit, not a W&B key
        "HTTPS_PROXY": "http://proxy.internal:3128",
        "GIT_REMOTE": "ssh://git@github.com/org/repo.git",  # a user without a password
        "SORT_KEY": "loss",
    }
    spec = parse_spec(GOOD, overrides=[f"env.{k}={v}" for k, v in values.items()])
    assert dict(spec.env) == values
    assert not [n for n in CONFIG_NAMES if is_secret_name(n)]
    spec = parse_spec(
        GOOD, overrides=["model.preset=null", "model.path=org/model", "data.path=s3://bucket/train.jsonl"]
    )
    assert spec.model.path == "org/model"
    notes = {"a": "Bearer authentication is used", "b": "Basic Configuration", "c": "see https://docs.example.com/x"}
    spec = parse_spec(GOOD, overrides=[f"scheduling.annotations={notes}", "env.AUTH_TYPE=Basic"])
    assert spec.scheduling.annotations == notes


# --- values ----------------------------------------------------------------------------------

TOKENS = {
    "bearer": "Bearer abcdefghijklmnopqrstuvwxyz012345",
    "private key": "-----BEGIN RSA PRIVATE KEY-----",
    "jwt": "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJl",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "gcp": "AIza" + "S" * 35,
    "gcp oauth": "ya29.a0AfH6SMBx1234567890abcdefghij",
    "azure": "DefaultEndpointsProtocol=https;AccountName=x;AccountKey=" + "A" * 40 + "==",
    "slack": "xoxb-1234567890-abcdefghij",
    "stripe": "sk_live_" + "a1" * 12,
    "github": "ghp_" + "a" * 36,
    "github pat": "github_pat_" + "B" * 30,
    "hf": "hf_" + "c" * 34,
    "openai": "sk-proj-" + "d" * 40,
    "anthropic": "sk-ant-api03-" + "e" * 40,
    "wandb": "0123456789abcdef0123456789abcdef01234567",
    "url": "postgres://user:s3cretPw@db.internal:5432/app",
}


@pytest.mark.parametrize("kind", sorted(TOKENS))
def test_token_shaped_values_are_refused_and_not_echoed(kind: str) -> None:
    value = TOKENS[kind]
    assert credential_kind(value, hex40=True)
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD + f"env:\n  MY_SETTING: {value!r}\n")
    text = str(info.value)
    assert "env.MY_SETTING" in text and "inline secret" in text
    assert not any(p in text for p in pieces(value) if p not in "-----BEGIN RSA PRIVATE KEY-----"), text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model.path", "https://user:hunter2pass@huggingface.co/org/model"),
        ("data.path", "https://me:hunter2pass@data.example.com/train.jsonl"),
        ("data.eval_path", "s3://AKIAIOSFODNN7EXAMPLE:hunter2pass@bucket/eval.jsonl"),
        ("image.name", "robot:hunter2pass@registry.example.com/team/runner:1"),
        ("image.name", "https://robot:hunter2pass@registry.example.com/team/runner-cuda:1"),
        ("scheduling.annotations.note", "Bearer hunter2passhunter2pass"),
    ],
)
def test_credentials_in_urls_are_refused_without_echo(field: str, value: str) -> None:
    overrides = [f"{field}={value}", "hardware.vendor=rocm"]  # rocm: the image rule also names the image
    if field == "model.path":
        overrides.append("model.preset=null")
    with pytest.raises(SpecError) as info:
        parse_spec(GOOD, overrides=overrides)
    text = str(info.value)
    assert field in text and "credential" in text, text
    assert "hunter2" not in text and "AKIAIOSFODNN7" not in text, text


# --- the property: never echoed, whatever the way ---------------------------------------------

ALNUM = string.ascii_letters + string.digits
PREFIXES = ["", "", "hf_", "ghp_", "sk-", "sk-ant-api03-", "xoxb-", "glpat-", "AKIA", "eyJ"]
WAYS = [
    "yaml",  # env: {NAME: value}
    "yaml-mapping",  # env: {NAME: {token: value}}
    "yaml-ref-secret",  # env: {NAME: {secret: value, key: k}}
    "yaml-key",  # env: {NAME: {value: 1}}
    "yaml-wrong-section",  # NAME: value at the root
    "set",  # --set env.NAME=value
    "set-mapping",  # --set env.NAME={a: value}
    "set-no-equals",  # --set "NAME value"
    "set-empty-key",  # --set =value
    "set-bare",  # --set value
    "set-split",  # --set NAME value (value becomes an unknown argument)
    "argv",  # jobspec validate spec.yaml value
    "option",  # jobspec render spec.yaml -o value
    "option-equals",  # jobspec render spec.yaml --output=value
]


@st.composite
def tokens(draw: st.DrawFn) -> str:
    body = draw(st.text(alphabet=ALNUM, min_size=20, max_size=40))
    assume(any(c.isdigit() for c in body) and any(c.isupper() for c in body) and any(c.islower() for c in body))
    return draw(st.sampled_from(PREFIXES)) + body


def invocation(way: str, name: str, value: str, spec: Path) -> tuple[list[str], str]:
    """(argv, spec text) passing `value` for `name` the given way."""
    argv, text = ["validate", str(spec)], GOOD
    if way == "yaml":
        text += f"env:\n  {name}: {value}\n"
    elif way == "yaml-mapping":
        text += f"env:\n  {name}: {{token: {value}}}\n"
    elif way == "yaml-ref-secret":
        text += f"env:\n  {name}: {{secret: {value}, key: k}}\n"
    elif way == "yaml-key":
        text += f"env:\n  {name}: {{{value}: 1}}\n"
    elif way == "yaml-wrong-section":
        text += f"{name}: {value}\n"
    elif way == "set":
        argv += ["--set", f"env.{name}={value}"]
    elif way == "set-mapping":
        argv += ["--set", f"env.{name}={{a: {value}}}"]
    elif way == "set-no-equals":
        argv += ["--set", f"{name} {value}"]
    elif way == "set-empty-key":
        argv += ["--set", f"={value}"]
    elif way == "set-bare":
        argv += ["--set", value]
    elif way == "set-split":
        argv += ["--set", name, value]
    elif way == "argv":
        argv += [value]
    elif way == "option":
        argv = ["render", str(spec), "-o", value]
    elif way == "option-equals":
        argv = ["render", str(spec), f"--output={value}"]
    return argv, text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=tokens(),
    name=st.sampled_from(SECRET_NAMES),
    way=st.sampled_from(WAYS),
    command=st.sampled_from(["validate", "render"]),
)
def test_a_secret_never_reaches_the_output(
    value: str, name: str, way: str, command: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    spec = tmp_path_factory.mktemp("spec") / "spec.yaml"
    argv, text = invocation(way, name, value, spec)
    if argv[0] == "validate":
        argv[0] = command
    spec.write_text(text)
    baseline_argv, baseline_text = invocation(way, name, "Zq" * 12, spec)
    spec.write_text(baseline_text)
    _, baseline = cli(*baseline_argv)
    assume(not any(p in baseline for p in pieces(value)))  # a piece that is plain output text anyway
    spec.write_text(text)
    with cpu_seconds() as spent:
        code, output = cli(*argv)
    assert spent.seconds < 2.0  # CPU seconds, no collection inside: a loaded machine cannot fail it
    assert code == 2, output
    leaked = [p for p in pieces(value) if p in output]
    assert not leaked, f"{way}: {leaked[:3]} in\n{output}"


# --- argparse --------------------------------------------------------------------------------


def test_argparse_shows_option_names_and_plain_words_only(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(GOOD)
    code, out = cli("validate", str(spec), "--frobnicate", "Tok3nValu3Xyz123456")
    assert code == 2 and "--frobnicate" in out and "1 more" in out and "Tok3n" not in out
    code, out = cli("valdate", str(spec))
    assert code == 2 and "'valdate'" in out and "did you mean 'validate'?" in out
    code, out = cli("render", str(spec), "-o", "jsn")
    assert code == 2 and "did you mean 'json'?" in out
    code, out = cli("run", str(spec), "--nproc", "eight")
    assert code == 2 and "invalid int value: 'eight'" in out
    code, out = cli("run", str(spec), "--nproc", "hf_abcdefghijklmnopqrstuvwxyz")
    assert code == 2 and "abcdef" not in out and "<not shown>" in out


# --- the API server's messages -----------------------------------------------------------------

JWT = "eyJhbGciOiJSUzI1NiIsImtpZCI6IkFCQyJ9.eyJpc3MiOiJrdWJlcm5ldGVzIiwic3ViIjoic3lzdGVtIn0.SIGnature_xyz-123ABC"


@pytest.mark.parametrize(
    "body",
    [
        f'{{"kind":"Status","message":"Unauthorized: token {JWT} expired"}}',
        '{"kind":"Status","message":"webhook said: Authorization: Bearer Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe"}',
        f"<html>proxy error for Bearer {JWT}</html>",
        '{"kind":"Status","message":"webhook denied: key q8W3rT6yU9iO2pA5sD8fG1hJ4kL7zX0cV3bN6mQ9wE2 leaked"}',
        '{"kind":"Status","message":"bad env value postgres://app:Sup3rS3cret@db:5432/x"}',
    ],
)
def test_api_error_bodies_are_scrubbed(body: str) -> None:
    op = Op("patch", "jobs", "batch", "ml", "demo")
    for status in (400, 401, 403, 409, 422, 500, 418):
        message = str(error_for_status(status, "Reason", body.encode(), op))
        for secret in (JWT, "Zx9Yw8Vu7Ts6", "q8W3rT6yU9iO", "Sup3rS3cret"):
            assert not (pieces(secret) & pieces(message, 6)), message
    assert "<redacted>" in server_message(body)


def test_ordinary_api_messages_are_kept() -> None:
    body = '{"kind":"Status","message":"jobs.batch \\"demo\\" is forbidden: User \\"system:serviceaccount:ml:x\\""}'
    assert server_message(body) == 'jobs.batch "demo" is forbidden: User "system:serviceaccount:ml:x"'
    uid = '{"message":"Precondition failed: UID in precondition: 6f1c0c1e-8d2a-4c1e-9a55-3f0b9d1e2a7b"}'
    assert "6f1c0c1e-8d2a-4c1e-9a55-3f0b9d1e2a7b" in server_message(uid)


def test_termination_reasons_are_scrubbed() -> None:
    report = parse_report(f'{{"exit_code": 1, "reason": "HTTPError: 401 for Bearer {JWT}"}}')
    assert report is not None and report.reason and JWT[:20] not in report.reason
    report = parse_report("Traceback ...\nOSError: cannot fetch https://u:Sup3rS3cret@hub/x")
    assert report is not None and "Sup3rS3cret" not in (report.reason or "")


def test_redact_leaves_ordinary_text_alone() -> None:
    text = "image ghcr.io/jobspec/runner:0.1.0-cuda@sha256:" + "ab" * 32 + " on node gpu-node-7, pod demo-0-x7k2p"
    assert redact(text, token_like=True) == text


# --- --debug ---------------------------------------------------------------------------------


def test_debug_keeps_exit_codes_and_prints_the_traceback(tmp_path: Path) -> None:
    code, out = cli("--debug", "validate", str(tmp_path / "missing.yaml"))
    *_, said, see = out.rstrip().splitlines()  # the error, then the page that explains it
    assert code == 2 and "Traceback" in out and said.startswith("error: ") and see.startswith("see: docs/")
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD + "env:\n  HF_TOKEN: hf_" + "k" * 30 + "\n")
    code, out = cli("validate", "--debug", str(bad))
    assert code == 2 and "Traceback" in out and "hf_kkkk" not in out and f"{bad}:10: env.HF_TOKEN" in out
    code, out = cli("validate", str(bad))
    assert code == 2 and "Traceback" not in out
