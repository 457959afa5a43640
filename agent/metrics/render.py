"""The exposition text of a scrape, byte for byte what prometheus_client writes, 6 to 11 times
faster (docs/benchmarks.md, the metrics section).

prometheus_client (0.26) spends about 20 µs of Python per sample: every sample's name goes
through a per-character escape loop, every label set is sorted and formatted again. A scrape of
8 GPUs has about 220 samples, so rendering took 4 to 6 ms, all of it holding the GIL an
Allocate arriving then waits for. The agent's metric names and label sets are fixed and few
(the label sets are bounded by design), so each sample's `name{labels}` text is made once and
kept; a scrape formats only the values.

Owns: choosing the fast path for what prometheus_client's content negotiation chose
(OpenMetrics or the 0.0.4 text format, with legacy-compatible escaping), and writing that
text. Anything else (another escaping scheme, a sample with a timestamp, an exemplar or a
native histogram, a name outside the legacy character set, a metric type the agent does not
export) is left to prometheus_client's own encoder, whole, given the families already
collected: a scrape reads NVML and asks podresources once whichever writer writes it. The
output is checked identical to prometheus_client's on awkward values
(tests/test_metrics_render.py) and on a live agent's scrapes (tests/test_metrics.py). Must
not gather anything: the families come from the registry's one collect() per scrape.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from prometheus_client import exposition
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

# Escaping schemes under which a legacy-valid name is written unchanged; the constants exist
# from prometheus_client 0.21 on (older versions write every name unchanged).
_PLAIN_ESCAPING = {getattr(openmetrics, "UNDERSCORES", "underscores"),
                   getattr(openmetrics, "ALLOWUTF8", "allow-utf-8")}
_LEGACY_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")  # metric and label names alike
_TYPES = ("gauge", "counter", "histogram", "info")  # what agent.metrics.families makes
_TEXT_TYPE = {"info": "gauge"}  # the 0.0.4 format has no info type
_TEXT_SUFFIX = {"counter": "_total", "info": "_info"}  # nor names without the suffix
_VALUES = {0.0: "0.0", 1.0: "1.0"}  # most samples (health, throttle bits, buckets' start)
_CACHE_LIMIT = 20_000  # label sets are bounded; past this something churns, start again


class Renderer:
    """`encoder(chosen)`: a fast encoder equal to prometheus_client's `chosen` (from
    choose_encoder), or `chosen` itself where the fast path does not apply."""

    def __init__(self) -> None:
        self._prefixes: dict[tuple, str] = {}  # (sample name, label items) -> 'name{...}'
        self._headers: dict[tuple, str] = {}  # (name, type, help, openmetrics) -> '# ...'

    def encoder(self, chosen: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
        func = getattr(chosen, "func", chosen)  # a functools.partial from 0.21 on
        keywords = getattr(chosen, "keywords", {})
        if keywords.get("escaping", "underscores") not in _PLAIN_ESCAPING:
            return chosen
        if func is openmetrics.generate_latest:
            om = True
        elif func is exposition.generate_latest:
            om = False
        else:
            return chosen

        def encode(registry: Any) -> bytes:
            families = list(registry.collect())  # once: the fallback writes these very ones
            return self.render(families, om) or chosen(_Collected(families))

        return encode

    def render(self, families: list[Any], om: bool) -> bytes | None:
        """The exposition of collected `families`; None when one needs prometheus_client."""
        out: list[str] = []
        for metric in families:
            if not self._family(metric, om, out):
                return None
        if om:
            out.append("# EOF\n")
        return "".join(out).encode("utf-8")

    def _family(self, metric: Any, om: bool, out: list[str]) -> bool:
        key = (metric.name, metric.type, metric.documentation, om)
        header = self._headers.get(key)
        if header is None:
            if metric.type not in _TYPES or getattr(metric, "unit", "") or \
                    not _LEGACY_NAME.match(metric.name):
                return False
            header = self._headers[key] = _header(metric, om)
        out.append(header)
        prefixes, suffixed = self._prefixes, metric.name + "_"
        for s in metric.samples:
            if s.timestamp is not None or s.exemplar is not None or \
                    getattr(s, "native_histogram", None) is not None:
                return False
            if not om and s.name != metric.name and s.name.startswith(suffixed) and \
                    s.name[len(suffixed):] in ("created", "gsum", "gcount"):
                return False  # the text format moves these to a family of their own
            labels = s.labels
            key = (s.name, tuple(labels.items()))
            prefix = prefixes.get(key)
            if prefix is None:
                prefix = _prefix(s.name, labels)
                if prefix is None:
                    return False
                if len(prefixes) >= _CACHE_LIMIT:
                    prefixes.clear()
                prefixes[key] = prefix
            value = s.value
            if value is None:
                return False
            out.append(f"{prefix} {_VALUES.get(value) or floatToGoString(value)}\n")
        return True


class _Collected:
    """Families collected once, as the registry prometheus_client's encoders collect from."""

    def __init__(self, families: list[Any]):
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


def _header(metric: Any, om: bool) -> str:
    name, kind = metric.name, metric.type
    if om:
        text = _quoted(metric.documentation)
    else:
        name, kind = name + _TEXT_SUFFIX.get(kind, ""), _TEXT_TYPE.get(kind, kind)
        text = _escape(metric.documentation)
    return f"# HELP {name} {text}\n# TYPE {name} {kind}\n"


def _prefix(name: str, labels: dict[str, str]) -> str | None:
    if not _LEGACY_NAME.match(name) or not all(map(_LEGACY_NAME.match, labels)):
        return None
    if not labels:
        return name
    pairs = ",".join(f'{k}="{_quoted(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{pairs}}}"


def _escape(text: str) -> str:
    """Backslash and newline escaped: a help text in the 0.0.4 format."""
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _quoted(text: str) -> str:
    """Double quotes escaped too: label values, and help texts in OpenMetrics."""
    return _escape(text).replace('"', r'\"')
