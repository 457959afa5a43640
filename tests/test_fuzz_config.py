"""Fuzzing config files: Hypothesis writes documents shaped like `version: v1` configs (every
key of the schema, NVIDIA's and ours, present or not, with values of the right kind or of any
other, unknown keys, nesting where none belongs) and checks what the agent makes of them.

A file is either accepted, and then `config show` of it reads back as the same configuration,
or refused with ConfigError naming a key path and the file, which `gpu-agent config check`
turns into exit 2 and that message on stderr. Anything else (a traceback, another exception,
another exit code) is a bug. In process for the many examples; a few through the real command.
"""

from __future__ import annotations

import re

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agent.config import check_config_file, format_config
from agent.config.file import SCHEMA
from agent.errors import ConfigError
from tests.conftest import run_gpu_agent

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10 ** 6),
                    st.floats(allow_nan=False), st.text(max_size=20),
                    st.sampled_from(["none", "single", "mixed", "envvar", "cdi-cri", "uuid",
                                     "index", "true", "30s", "/run/x", "nvidia.com/gpu",
                                     "GPU-0", "0:1", "all", "v1", ""]))
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)
# What NVIDIA's sections hold: resources.gpus/mig patterns, sharing.timeSlicing/mps resources
section_values = st.one_of(anything, st.fixed_dictionaries({}, optional={
    "gpus": st.lists(st.fixed_dictionaries({"pattern": scalars, "name": scalars}), max_size=3),
    "mig": st.lists(st.fixed_dictionaries({"pattern": scalars, "name": scalars}), max_size=3),
    "renameByDefault": scalars, "failRequestsGreaterThanOne": scalars,
    "resources": st.lists(st.fixed_dictionaries({"name": scalars}, optional={
        "rename": scalars, "devices": st.one_of(scalars, st.lists(scalars, max_size=3)),
        "replicas": scalars}), max_size=3),
    "timeSlicing": anything, "mps": anything}))


@st.composite
def documents(draw, schema=SCHEMA, depth=0):
    doc = {}
    for key, spec in schema.items():
        if draw(st.integers(0, 3)) > 0:  # a key in four: a few wrong values per file at most
            continue
        if isinstance(spec, dict):  # a group: its keys mostly, anything at all sometimes
            doc[key] = draw(documents(spec, depth + 1) if draw(st.integers(0, 4)) else anything)
        elif depth == 0 and key != "version":
            doc[key] = draw(section_values)
        else:
            doc[key] = draw(scalars)
    if depth == 0 and draw(st.integers(0, 19)) > 0:
        doc["version"] = "v1"  # mostly: else nothing past the version would be reached
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.text(min_size=1, max_size=10))] = draw(anything)
    return doc


def _values(shown: str) -> list[str]:
    return [re.sub(r"\s+# .*$", "", line) for line in shown.splitlines()
            if not line.startswith("#")]


def _write(tmp_path, doc) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return str(path)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(doc=documents())
def test_any_config_file_is_accepted_and_shown_or_refused_naming_key_and_file(tmp_path, doc):
    path = _write(tmp_path, doc)
    try:
        cfg = check_config_file(path)
    except ConfigError as exc:
        assert exc.key and exc.problem and exc.source == path, exc
        assert str(exc).endswith(f"({path})")
        event(f"refused at {exc.key.split('.')[0].split('[')[0]}")  # --hypothesis-show-statistics
        return
    event("accepted")
    shown = format_config(cfg)
    again = tmp_path / "shown.yaml"
    again.write_text(shown)
    # shows what it read: the shown file reads back as the same settings (the comments, which
    # say where each came from, differ: now every one is from a file)
    assert _values(format_config(check_config_file(str(again)))) == _values(shown)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(doc=documents())
def test_gpu_agent_config_check_exits_0_or_2_naming_the_key_and_file(tmp_path, doc):
    path = _write(tmp_path, doc)
    proc = run_gpu_agent("config", "check", path, check=False)
    try:
        check_config_file(path)
    except ConfigError as exc:
        assert (proc.returncode, proc.stderr) == (2, f"gpu-agent: error: {exc}\n")
    else:
        assert (proc.returncode, proc.stdout) == (0, f"{path}: ok\n"), proc.stderr
