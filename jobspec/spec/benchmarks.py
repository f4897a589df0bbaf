"""`eval.benchmarks` on the submitter's side (no lm-eval, no torch): which entries are task YAML files, where they
are, and whether each one is a task that lm-evaluation-harness can read. The Python files of `training.grpo.rewards`
travel with the job the same way (`shipped_entries`, `reward_file_problem`): compiled here, never run.

An entry ending in .yaml/.yml is a file of the user's (a task of their own, with its data set); any other entry is a
task or group name of lm-evaluation-harness (its data set comes from the hub). A relative file is relative to the
spec file's directory (`jobspec validate` and `jobspec run` here, the runner's preflight in the pod); under
`jobspec eval RUN_DIR --tasks`, to the working directory. Checked here: the file is a regular file of at most
MAX_TASK_BYTES, YAML, and a mapping with a `task` key (what lm-eval's task index looks for). The YAML is read within
safe_yaml's bounds and only looked at: no tag (such as lm-eval's `!function utils.process_docs`) is constructed or
run here. The runner then builds the tasks with lm-eval (runner/output/benchmarks.py), which reads the rest
(dataset, prompts, metrics).

Shipped with a job (`jobspec render`/`submit`): every relative task file travels in the job's spec ConfigMap, under
a key of its own (`shipped_paths`), and the pod mounts it at the same path relative to the spec
(/etc/jobspec/<path>), so a relative entry resolves there as it does on one machine. Such a file must lie under the
spec file's directory (no `..`), and together they hold at most MAX_SHIPPED_BYTES (a ConfigMap holds 1 MiB).
Files the task YAML itself names (its data_files, an `include:`) are not shipped: give those as absolute paths in
the pod (the image or a volume), or use a hub data set.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jobspec.errors import ConfigError
from jobspec.spec import safe_yaml
from jobspec.spec.credentials import credential_kind, is_secret_name
from jobspec.untrusted import read_bounded

TASK_FILE_SUFFIXES = (".yaml", ".yml")
REWARD_FILE_SUFFIX = ".py"  # training.grpo.rewards' Python files ship the same way
MAX_TASK_BYTES = 1 << 20  # a task YAML is a page; its data lives in files of its own
MAX_SHIPPED_BYTES = 512 << 10  # the task files of one job's ConfigMap, together (Kubernetes caps one at 1 MiB)
_KEY_CHARS = re.compile(r"[^-._A-Za-z0-9]")  # what a ConfigMap key may not hold


def is_task_file(entry: str) -> bool:
    """`entry` names a task YAML file (else an lm-evaluation-harness task or group name)."""
    return entry.lower().endswith(TASK_FILE_SUFFIXES)


def is_shipped_file(entry: str) -> bool:
    """`entry` is a file that travels with the job when relative: a task YAML or a reward function's Python file."""
    return is_task_file(entry) or entry.endswith(REWARD_FILE_SUFFIX)


def shipped_entries(spec: Any) -> list[str]:
    """The spec's entries that may name files shipped with the job: `eval.benchmarks`, then the Python files of
    `training.grpo.rewards` (each entry's field: `shipped_fields`)."""
    return [entry for _, entry in _shipped(spec)]


def shipped_fields(spec: Any) -> list[str]:
    """The field of each of `shipped_entries`, for errors: `eval.benchmarks[i]`, `training.grpo.rewards[i].file`."""
    return [field for field, _ in _shipped(spec)]


def _shipped(spec: Any) -> list[tuple[str, str]]:
    grpo = getattr(spec.training, "grpo", None)
    rewards = [(f"training.grpo.rewards[{i}].file", r.file) for i, r in enumerate(grpo.rewards if grpo else [])
               if r.file]  # fmt: skip
    return [*((f"eval.benchmarks[{i}]", b) for i, b in enumerate(spec.eval.benchmarks)), *rewards]


def _shipped_text(path: Path, what: str) -> tuple[str | None, str]:
    """(the text of a file a job may carry, "") or (None, why it cannot be read): absent, not a regular file, over
    MAX_TASK_BYTES, not UTF-8, unreadable."""
    if not path.exists() and not path.is_symlink():
        return None, "no such file"
    try:
        return read_bounded(path, MAX_TASK_BYTES, what=what).decode("utf-8"), ""
    except ConfigError as err:  # not a regular file, too large
        return None, str(err)
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"


def reward_file_problem(path: Path) -> str | None:
    """Why `path` is not a reward function's Python file the job can carry; None when it is. Compiled, never run
    here (the runner runs it in the pod, because the spec names it); refused when it holds a credential (a shipped
    file is in the job's ConfigMap, printed by render)."""
    text, why = _shipped_text(path, "reward file")
    if text is None:
        return why
    try:
        compile(text, str(path), "exec")  # parsed only: nothing in it runs here
    except SyntaxError as err:
        return f"line {err.lineno}: not Python ({err.msg})"
    except ValueError as err:  # a NUL byte
        return f"not Python ({err})"
    for number, line in enumerate(text.splitlines(), 1):
        for word in re.findall(r"[^\s'\"=:,()\[\]{}]+", line):
            if kind := credential_kind(word):
                return (f"line {number} holds a credential ({kind}; not shown: a shipped file is in the job's "
                        "ConfigMap, printed by render); read it from the environment in the function instead, "
                        "and give it to the pod from a Secret (env: {NAME: {secret: NAME, key: KEY}})")  # fmt: skip
    return None


def check_reward_files(spec: Any, base: str | Path, *, absent_absolute_ok: bool = False) -> list[str]:
    """ConfigError (exit 2) naming the reward, the file and the fix for the first Python reward file that is not
    one; notes for absolute paths this machine lacks (`absent_absolute_ok`: the pod's)."""
    grpo = getattr(spec.training, "grpo", None)
    notes = []
    for i, reward in enumerate(grpo.rewards if grpo is not None else []):
        if not reward.file:
            continue
        field = f"training.grpo.rewards[{i}].file"
        path = Path(reward.file) if Path(reward.file).is_absolute() else Path(base) / reward.file
        why = reward_file_problem(path)
        if why == "no such file" and absent_absolute_ok and Path(reward.file).is_absolute():
            notes.append(f"{field} {reward.file} is not on this machine: it must be in the pod (image or volume)")
        elif why is not None:
            where = "" if Path(reward.file).is_absolute() else f" (relative to {Path(base).resolve()})"
            raise ConfigError(f"{field} {reward.file}: {path}{where}: {why}; give a Python file that defines "
                              f"{reward.function!r}")  # fmt: skip
    return notes


def task_files(entries: Sequence[str], base: str | Path) -> list[tuple[int, Path]]:
    """(index, path) of every task file among `entries`, a relative one resolved against `base`."""
    return [(i, Path(base) / e) for i, e in enumerate(entries) if is_task_file(e)]


def hub_tasks(entries: Sequence[str]) -> list[str]:
    """The entries that are lm-evaluation-harness task names (their data sets come from the hub)."""
    return [e for e in entries if not is_task_file(e)]


def task_file_problem(path: Path) -> str | None:
    """Why `path` is not a task YAML lm-evaluation-harness can index; None when it is."""
    text, why = _shipped_text(path, "task file")
    if text is None:
        return why
    try:
        root = safe_yaml.compose(text)  # bounded (size, nodes, depth); nothing constructed, so no tag runs
    except safe_yaml.YamlLimit as err:
        return f"line {err.line}: {err.message}"
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        return f"not YAML{where}: {getattr(err, 'problem', None) or err}"
    if not _names_a_task(root):
        return (
            "not an lm-evaluation-harness task (a task YAML is a mapping with a `task:` name, its dataset_path, "
            "prompts and metric_list)"
        )
    if found := _credential(root):
        line, kind = found
        return (f"line {line} holds a credential ({kind}; not shown: a task file is shipped in the job's ConfigMap "
                "and printed by render); remove it and give it to the pod from a Secret (env: {HF_TOKEN: {secret: "
                "NAME, key: KEY}}, which lm-evaluation-harness and the hub client read)")  # fmt: skip
    return None


def _credential(root: yaml.Node) -> tuple[int, str] | None:
    """(line, kind) of the first credential in a composed YAML document: a scalar value under a secret-like key
    (`token: hf_...`, `api_key: ...`) or a credential-shaped scalar anywhere (a token, a URL with a password). The
    nodes are only looked at: nothing is constructed."""
    todo: list[yaml.Node] = [root]
    while todo:
        node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if (isinstance(key, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode)
                        and is_secret_name(str(key.value)) and str(value.value).strip().lower()
                        not in ("", "null", "~", "true", "false", "none")):  # fmt: skip
                    return value.start_mark.line + 1, f"a value under {str(key.value)[:40]!r}"
                todo += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            todo += node.value
        elif isinstance(node, yaml.ScalarNode) and (kind := credential_kind(str(node.value))):
            return node.start_mark.line + 1, kind
    return None


def _names_a_task(root: yaml.Node | None) -> bool:
    """The document is a mapping whose `task` is a name (or, for a group, a list of tasks)."""
    if not isinstance(root, yaml.MappingNode):
        return False
    values = [v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "task"]
    return bool(values) and isinstance(values[-1], yaml.ScalarNode | yaml.SequenceNode) and bool(values[-1].value)


def check_task_files(entries: Sequence[str], base: str | Path, field: str = "eval.benchmarks", *,
                     absent_absolute_ok: bool = False) -> list[str]:  # fmt: skip
    """ConfigError (exit 2) naming the field, the file and the fix for the first task file that is not a task.

    `absent_absolute_ok` (`jobspec validate` of a spec for a cluster): an absolute path that is not on this machine is
    the pod's (an image's or a volume's file); it is returned as a note instead, and the runner checks it there."""
    notes = []
    for i, path in task_files(entries, base):
        why = task_file_problem(path)
        if why == "no such file" and absent_absolute_ok and Path(entries[i]).is_absolute():
            notes.append(f"{field}[{i}] {entries[i]} is not on this machine: it must be in the pod (image or volume)")
        elif why is not None:
            where = "" if Path(entries[i]).is_absolute() else f" (relative to {Path(base).resolve()})"
            raise ConfigError(f"{field}[{i}] {entries[i]}: {path}{where}: {why}; give the path of an "
                              "lm-evaluation-harness task YAML, or a task name such as arc_easy")  # fmt: skip
    return notes


def shipped_paths(entries: Sequence[str], field: str = "eval.benchmarks",
                  fields: Sequence[str] | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """(ConfigMap key, path relative to the spec's directory) of each relative task file among `entries`, once
    each: what the job's ConfigMap carries and the pod mounts beside the spec. ConfigError for one outside the
    spec's directory (the pod's mount holds nothing above it)."""
    out: dict[str, str] = {}
    for i, entry in enumerate(entries):
        if not is_shipped_file(entry) or Path(entry).is_absolute():
            continue
        path = posixpath.normpath(entry)
        if path == ".." or path.startswith("../"):
            where = fields[i] if fields else f"{field}[{i}]"
            raise ConfigError(f"{where} {entry}: a file shipped with the job must be under the spec file's "
                              "directory (the pod mounts the task files beside the spec, in /etc/jobspec); move it "
                              "there, or give an absolute path that exists in the pod (image or volume)")  # fmt: skip
        out.setdefault(path, f"task-{len(out)}-{_KEY_CHARS.sub('_', posixpath.basename(path))}")
    return [(key, path) for path, key in out.items()]


def ship_task_files(entries: Sequence[str], base: str | Path, field: str = "eval.benchmarks",
                    fields: Sequence[str] | None = None) -> dict[str, str]:  # fmt: skip
    """{relative path: text} of the relative task files among `entries`, read from under `base` (the spec file's
    directory) for the job's ConfigMap: each one a task (as check_task_files), all of them within
    MAX_SHIPPED_BYTES. ConfigError naming the field, the entry and the fix otherwise."""
    given = {posixpath.normpath(e): (i, e) for i, e in reversed(list(enumerate(entries))) if is_shipped_file(e)}
    texts: dict[str, str] = {}
    total = 0
    for _, path in shipped_paths(entries, field, fields):
        i, entry = given[path]
        where = fields[i] if fields else f"{field}[{i}]"
        file = Path(base) / path
        reward = not is_task_file(path)
        why = reward_file_problem(file) if reward else task_file_problem(file)
        if why is not None:
            fix = ("give a Python file of reward functions" if reward else "give the path of an "
                   "lm-evaluation-harness task YAML, or a task name such as arc_easy")  # fmt: skip
            raise ConfigError(f"{where} {entry}: {file} (relative to {Path(base).resolve()}): {why}; {fix}")
        try:  # never through a link (or a linked directory) out of the spec's directory: render would ship it
            texts[path] = read_bounded(file, MAX_TASK_BYTES, what=f"{where} file", root=base).decode("utf-8")
        except ConfigError as err:
            raise ConfigError(f"{err}; a task file shipped with the job must be a file under the spec file's "
                              "directory") from None  # fmt: skip
        total += len(texts[path].encode("utf-8"))
        if total > MAX_SHIPPED_BYTES:
            raise ConfigError(f"{where} {entry}: the files shipped in the job's ConfigMap come to "
                              f"{total:,} bytes with this one, over the {MAX_SHIPPED_BYTES:,} allowed (Kubernetes "
                              "holds a ConfigMap to 1 MiB); put large task files in the image or on a volume and "
                              "give their absolute paths")  # fmt: skip
    return texts
