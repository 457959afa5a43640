"""The Grafana dashboard (packaging/grafana/gpu-agent-dashboard.json) against the agent it shows:
the JSON is a dashboard Grafana imports (every panel titled, every query on the templated
Prometheus data source), every metric name a panel or a variable queries is one a real
`gpu-agent run` on the simulated node exports, with series, and every family it exports is on
the dashboard; and a real Prometheus scraping that agent runs every query without an error
and finds series for it. A metric renamed in agent/metrics/families.py fails here until the
dashboard follows.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.sim import control
from tests.conftest import ROOT
from tests.daemon_harness import GPU, Agent, Node
from tests.test_metrics import metrics_port, scrape_text
from tests.test_metrics_prometheus import PROMETHEUS_WAIT, Prometheus

DASHBOARD = ROOT / "packaging" / "grafana" / "gpu-agent-dashboard.json"
DATASOURCE_VARIABLE = "DS_PROMETHEUS"
PREFIX = "gpu_agent_"

# Memory repair follows the architecture (agent/nvml/telemetry.py): a GPU before Ampere retires
# pages and has no row remapping, Ampere and later the other way round. These families have no
# series on a node of the other kind; each profile below is one kind.
RETIRED_PAGES = {"gpu_agent_gpu_retired_pages_pending"}
REMAPPED_ROWS = {"gpu_agent_gpu_remapped_rows", "gpu_agent_gpu_remapped_rows_pending",
                 "gpu_agent_gpu_remapped_rows_failed"}
NOT_ON_THIS_GPU = {"dgx1-v100": REMAPPED_ROWS, "dgx-h100": RETIRED_PAGES}

# What each Grafana variable stands for when a query goes straight to Prometheus.
GRAFANA_VARIABLES = {"instance": ".*", "gpu": ".*", "__rate_interval": "1m",
                     "__interval": "15s", "__range": "1h"}

# PromQL words that are not metric names (functions and aggregations are told by their "(").
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and",
                   "or", "unless", "bool", "offset", "inf", "nan"}


# -- reading the dashboard ---------------------------------------------------------------------


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data: rows (expanded or collapsed) only hold others."""
    out = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(f"panel {p['title']!r} target {t.get('refId')}", t["expr"])
           for p in panels(dashboard) for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", query))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names PromQL `expr` selects (or a Grafana `label_values(selector, label)`)."""
    label_values = re.fullmatch(r"\s*label_values\((?:(.*),)?\s*\w+\s*\)\s*", expr, re.S)
    if label_values:
        expr = label_values.group(1) or ""
    expr = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[A-Za-z_:][\w:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group().lower() in PROMQL_KEYWORDS:
            continue  # a function, an aggregation, an operator
        names.add(m.group())
    return names


def for_prometheus(expr: str) -> str:
    """`expr` with Grafana's variables ($name, ${name}) replaced as GRAFANA_VARIABLES says."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: GRAFANA_VARIABLES[m.group(1) or m.group(2)],
                  expr)


def used_names() -> dict[str, list[str]]:
    """metric name -> where the dashboard queries it."""
    used: dict[str, list[str]] = {}
    for where, expr in expressions(load()):
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    return used


@pytest.mark.parametrize("expr, names", [
    ('sum by (le) (rate(a_bucket{m="x", i=~"$instance"}[$__rate_interval]))', {"a_bucket"}),
    ("histogram_quantile(0.99, sum by (le, x) (rate(b[5m])))", {"b"}),
    ("count(c == 0) or vector(0)", {"c"}),
    ("d / on (gpu) group_left (uuid) e offset 5m > 1e3", {"d", "e"}),
    ('label_values(f{instance=~"$instance"}, gpu)', {"f"}),
    ("label_values(gpu)", set()),
    ("(increase(g[$__range]) > 0) or ((g unless g offset $__range) > 0)", {"g"}),
], ids=["selector", "quantile", "or-vector", "matching", "label-values", "label-only",
        "offset-variable"])
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


# -- the JSON ----------------------------------------------------------------------------------


def test_the_dashboard_is_json_grafana_imports():
    d = load()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    source = variables[DATASOURCE_VARIABLE]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    assert variables["instance"]["type"] == "query"
    assert "__inputs" not in d  # provisioning would not fill them; the variable serves both


def test_every_panel_has_a_title_and_queries_the_templated_data_source():
    d = load()
    reference = {"type": "prometheus", "uid": f"${{{DATASOURCE_VARIABLE}}}"}
    shown = panels(d)
    assert len(shown) >= 20
    for p in shown:
        assert p.get("title", "").strip(), p
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"panel {p['title']!r} target {t.get('refId')}"
            assert (t.get("datasource") or p.get("datasource")) == reference, p["title"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == reference, v["name"]


def test_panels_have_distinct_ids_and_titles_and_do_not_overlap():
    d = load()
    every = d["panels"] + [c for p in d["panels"] for c in p.get("panels", [])]
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in every]  # scripts/render-dashboard picks panels by title
    assert sorted(t for t in set(titles) if titles.count(t) > 1) == []
    cells: dict[tuple[int, int], str] = {}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_query_uses_only_the_agents_metrics():
    # its own (gpu_agent_*) and its process's (process_*, prometheus_client's process collector
    # on the same endpoint, each query joined to gpu_agent_build_info so that no other job's
    # process is shown)
    used = used_names()
    assert used and sorted(n for n in used if not n.startswith((PREFIX, "process_"))) == []
    for panel in load()["panels"]:
        for target in panel.get("targets", []):
            if re.search(r"(?<![a-z_])process_", target["expr"]):
                assert target["expr"].endswith(
                    'and on (instance) gpu_agent_build_info{instance=~"$instance"}'), target


# -- against a running agent -------------------------------------------------------------------


def start(node: Node) -> tuple[Agent, int]:
    """`gpu-agent run` on `node`, registered; returns it and its metrics port."""
    agent = node.agent()
    agent.wait_registered()
    return agent, metrics_port(node)


def exercise(node: Node, agent: Agent) -> None:
    """Every labelled series there on the agent's node: a pod holding two GPUs, an XID that
    withdraws one, a single-bit ECC error, telemetry set on others (a pending row remapping on
    GPUs that remap rows, pending retired pages on those that retire pages), a lost GPU whose
    readings fail."""
    node.client.admit_pod("trainer", {"main": {GPU: 2}}, namespace="ml")
    devices = node.client.state().resource(GPU).devices
    control.inject_xid(node.ctl, devices[3].id, 79)
    control.set_telemetry(0, node.ctl, gpu_util=87, mem_util=41, memory_used_mib=9000,
                          temperature_c=71, power_mw=231_000, sm_clock_mhz=1380,
                          throttle_reasons=0x4)
    if NOT_ON_THIS_GPU[node.profile] == RETIRED_PAGES:  # the GPUs remap rows
        control.set_telemetry(1, node.ctl, remapped_correctable=2, remapped_pending=1)
    else:
        control.set_telemetry(1, node.ctl, retired_pending=1)
    control.ecc(node.ctl, 2, double_bit=False)
    control.lose(node.ctl, 7)
    agent.wait_for(lambda s: not s.resource(GPU).device(devices[3].id).healthy, "XID 79 seen")


def exposition(port: int) -> tuple[set[str], set[str]]:
    """(names the exposition declares, names with samples); a family's declared names are its
    samples' names as its type makes them (counter: _total; histogram: _bucket, _count, _sum)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "summary": ("", "_count", "_sum"), "info": ("_info",)}
    deadline = time.monotonic() + 20
    while True:  # the lost GPU's failed reading is counted by the scrape that tried it
        families = list(text_string_to_metric_families(scrape_text(port)))
        populated = {s.name for f in families for s in f.samples}
        if "gpu_agent_gpu_telemetry_failures_total" in populated or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    declared = {f.name + s for f in families for s in suffixes.get(f.type, ("",))}
    return declared | populated, populated


@pytest.mark.parametrize("profile", sorted(NOT_ON_THIS_GPU))
def test_every_metric_the_dashboard_uses_is_exported_with_series(profile):
    used = used_names()
    with Node(profile) as node:
        agent, port = start(node)
        exercise(node, agent)
        declared, populated = exposition(port)
    missing = {n: where for n, where in used.items() if n not in declared}
    assert missing == {}, "the dashboard queries metrics the agent does not export"
    empty = sorted(set(used) - populated - NOT_ON_THIS_GPU[profile])
    assert empty == [], f"no series on a {profile} node for these dashboard metrics"
    assert not NOT_ON_THIS_GPU[profile] & populated  # the split above is still the agent's
    families = {n for n in declared if n.startswith(PREFIX)}
    histogram_parts = {n for n in families if re.search(r"_(bucket|count|sum)$", n)}
    unused = sorted(n for n in families - histogram_parts if n not in used)
    unused += sorted({re.sub(r"_(bucket|count|sum)$", "", n) for n in histogram_parts}
                     - {re.sub(r"_(bucket|count|sum)$", "", n) for n in used})
    assert unused == [], "exported families no dashboard panel shows: add a panel"


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus not installed (make test installs Debian's prometheus "
                           "as root)")
def test_prometheus_runs_every_query_and_finds_series():
    d = load()
    with Node() as node:
        agent, port = start(node)
        prometheus = Prometheus(node.root, port)
        try:
            # what happens next is seen as it happens: the ECC counter goes up from 0
            prometheus.query_until("count(gpu_agent_gpu_ecc_errors_total)", bool, "a scrape")
            exercise(node, agent)
            prometheus.query_until("sum(gpu_agent_gpu_ecc_errors_total) > 0", bool,
                                   "the ECC error scraped")
            prometheus.query_until("count(gpu_agent_gpu_telemetry_failures_total) > 0", bool,
                                   "the lost GPU's failure counted")
            # rate() and increase() need two samples in their window: scraped every second
            prometheus.query_until("count_over_time(gpu_agent_gpu_ecc_errors_total[1m]) >= 3",
                                   bool, "three scrapes")
            empty = []
            for where, expr in expressions(d):
                if where.startswith("variable"):
                    selector = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr)
                    result = prometheus.api(f"label/{selector.group(2)}/values", **{
                        "match[]": for_prometheus(selector.group(1))})
                else:
                    result = run_query(prometheus, for_prometheus(expr), where)
                if not result and not metric_names(expr) <= NOT_ON_THIS_GPU[node.profile]:
                    empty.append(where)
            assert empty == [], "queries that find nothing on the exercised node"
        finally:
            prometheus.stop()


def run_query(prometheus: Prometheus, query: str, where: str) -> list:
    """The instant query's result; a query Prometheus refuses fails naming the panel."""
    deadline = time.monotonic() + PROMETHEUS_WAIT
    while True:
        try:
            return prometheus.api("query", query=query)["result"]
        except urllib.error.HTTPError as exc:  # 400 bad_data: PromQL that does not parse
            raise AssertionError(f"{where}: Prometheus refused {query!r}: "
                                 f"{exc.read().decode(errors='replace')}") from None
        except OSError:
            if time.monotonic() > deadline:
                raise

